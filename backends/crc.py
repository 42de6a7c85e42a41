"""CRC-32 with zlib's polynomial and framing: the checksum every stored value, segment
record and batch member carries, computed as fast as this machine can.

isal's (Intel ISA-L, folding with carry-less multiplies: 60+ GB/s on this machine) when the
package is installed, else zlib's (2.6-4.3 GB/s here). Both give the same numbers for the
same bytes and the same starting value, so stores, clients and tools mix them freely.
"""

from __future__ import annotations

try:
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is a dependency; a bare environment still works
    from zlib import crc32

__all__ = ["crc32"]
