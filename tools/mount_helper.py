"""`mount.fuse.distorefs`: the helper mount(8) runs for `mount -t fuse.distorefs` and fstab lines.

mount(8) calls it as `mount.fuse.distorefs STORE MOUNTPOINT [-sfnv] [-o OPTIONS] [-t TYPE]`.
OPTIONS mix generic mount options (ignored: they mean nothing to a FUSE daemon or are
handled by mount(8) and systemd: `defaults`, `rw`, `auto`, `noauto`, `nofail`, `_netdev`,
`x-systemd.*`, ...) with distorefs ones: `ro` (`distorefs mount --read-only`), `allow_other`, `nvme_dir=PATH[:SIZE]`
(repeatable), `debug`, and any
store setting (`cache_bytes=4294967296`, `sync_interval=2`, ...). It mounts like
`distorefs mount` does (the daemon goes to the background, the helper returns once the
mount is ready) and exits non-zero with a message if the mount fails.
"""

from __future__ import annotations

import dataclasses
import sys

# Options mount(8), the kernel or systemd deal with; the daemon needs none of them.
IGNORED = {"defaults", "rw", "auto", "noauto", "user", "nouser", "users", "nofail", "_netdev", "suid", "nosuid",
           "dev", "nodev", "exec", "noexec", "async", "atime", "noatime", "relatime", "strictatime", "nodiratime",
           "lazytime", "owner", "group", "comment", "default_permissions", "fsname", "subtype"}
IGNORED_PREFIXES = ("x-", "comment=", "fsname=", "subtype=")


def parse(argv: list[str]) -> tuple[list[str], bool]:
    """The `distorefs mount` arguments for a mount(8)-style command line; and whether to
    only pretend (-f, "fake")."""
    from distorefs.config import StoreConfig

    settings = {f.name for f in dataclasses.fields(StoreConfig)}
    positional, options, fake = [], [], False
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "-o":
            i += 1
            if i == len(argv):
                raise SystemExit("mount.fuse.distorefs: -o needs a value")
            options += argv[i].split(",")
        elif arg.startswith("-o"):
            options += arg[2:].split(",")
        elif arg == "-t":
            i += 1  # the type (fuse.distorefs): nothing to do with it
        elif arg.startswith("-") and len(arg) > 1:
            fake |= "f" in arg[1:]  # -f: fake; -s (sloppy), -n (no mtab), -v (verbose): nothing to do
        else:
            positional.append(arg)
        i += 1
    if len(positional) != 2:
        raise SystemExit("usage: mount.fuse.distorefs STORE MOUNTPOINT [-o OPTIONS]")
    store, mountpoint = positional
    args = ["mount", store, mountpoint]
    for opt in filter(None, (o.strip() for o in options)):
        key, _, value = opt.partition("=")
        if opt in IGNORED or key in IGNORED or opt.startswith(IGNORED_PREFIXES):
            continue
        if opt == "ro":
            args.append("--read-only")
        elif opt == "allow_other":
            args.append("--allow-other")
        elif opt == "debug":
            args.append("--debug")
        elif key == "nvme_dir" and value:
            args += ["--nvme-dir", value]
        elif key in settings and value:
            args += ["-o", opt]
        else:
            raise SystemExit(f"mount.fuse.distorefs: unknown option {opt!r}")
    return args, fake


def main(argv: list[str] | None = None) -> None:
    args, fake = parse(sys.argv[1:] if argv is None else argv)
    if fake:
        return
    from .cli import main as cli
    cli.main(args=args, prog_name="mount.fuse.distorefs")


if __name__ == "__main__":
    main()
