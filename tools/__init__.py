"""The `distorefs` command line: mount, umount, status, stats, bench."""
