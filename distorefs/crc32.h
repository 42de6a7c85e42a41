/*
 * CRC-32 as zlib's (reflected, polynomial 0xEDB88320), eight bytes a step, for the C parts
 * that checksum what Python reads back with zlib or backends/crc.py: distorefs/_batchfill.c
 * (a batch file's members) and mount/_interpose.c (records of the priority write-ahead file).
 * Linking zlib instead would make its headers a build dependency for these forty lines.
 */
#ifndef DISTOREFS_CRC32_H
#define DISTOREFS_CRC32_H

#include <stdint.h>
#include <string.h>

static uint32_t crc32_table[8][256];
static int crc32_ready;

/* Built at the first use; two threads racing build the same values. */
static void crc32_init(void)
{
    if (__atomic_load_n(&crc32_ready, __ATOMIC_ACQUIRE))
        return;
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc32_table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++)
        for (int t = 1; t < 8; t++)
            crc32_table[t][n] = (crc32_table[t - 1][n] >> 8) ^ crc32_table[0][crc32_table[t - 1][n] & 0xFF];
    __atomic_store_n(&crc32_ready, 1, __ATOMIC_RELEASE);
}

/* zlib's crc32(crc, p, n): `crc` the CRC of what came before (0 to start). */
static uint32_t crc32_of(uint32_t crc, const unsigned char *p, size_t n)
{
    crc32_init();
    crc = ~crc;
    while (n && ((uintptr_t)p & 7)) {
        crc = crc32_table[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
        n--;
    }
    while (n >= 8) {
        uint32_t lo, hi;
        memcpy(&lo, p, 4);
        memcpy(&hi, p + 4, 4);
        lo ^= crc;
        crc = crc32_table[7][lo & 0xFF] ^ crc32_table[6][(lo >> 8) & 0xFF] ^ crc32_table[5][(lo >> 16) & 0xFF] ^
              crc32_table[4][lo >> 24] ^ crc32_table[3][hi & 0xFF] ^ crc32_table[2][(hi >> 8) & 0xFF] ^
              crc32_table[1][(hi >> 16) & 0xFF] ^ crc32_table[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n--)
        crc = crc32_table[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return ~crc;
}

#endif
