#!/bin/sh
# Install shmctl's systemd units with ExecStart naming the shmctl they should run.
#
# The units in deploy/systemd say `ExecStart=shmctl ...`: systemd resolves a bare name through
# its own fixed search path (/usr/local/sbin, /usr/local/bin, /usr/sbin, /usr/bin), never
# through $PATH, so they work as they are only where shmctl is installed there (a system-wide
# `pip install .`). Anywhere else (a virtual environment in /opt, pipx) this writes the absolute
# path into every ExecStart.
#
# usage: install-units.sh [--shmctl PATH] [--dest DIR] [--from DIR]
#   --shmctl PATH  the shmctl to run (default: the one on $PATH)
#   --dest DIR     where the units go (default: /etc/systemd/system)
#   --from DIR     where the unit templates are (default: deploy/systemd of this checkout, or
#                  the systemd/ beside this script in PREFIX/share/shmctl, or
#                  PREFIX/share/shmctl/systemd of the shmctl given)
# It installs and prints the next step; it never starts, enables or reloads anything.
set -eu

die() {
    echo "install-units: error: $*" >&2
    exit 2
}

shmctl=$(command -v shmctl || true)
dest=/etc/systemd/system
from=
while [ $# -gt 0 ]; do
    case $1 in
        --shmctl) [ $# -ge 2 ] || die "--shmctl needs a path"; shmctl=$2; shift 2 ;;
        --dest) [ $# -ge 2 ] || die "--dest needs a directory"; dest=$2; shift 2 ;;
        --from) [ $# -ge 2 ] || die "--from needs a directory"; from=$2; shift 2 ;;
        -h | --help) sed -n '2,/^set -eu/{/^set -eu/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
        *) die "unknown argument '$1' (fix: see --help)" ;;
    esac
done

[ -n "$shmctl" ] || die "no shmctl on \$PATH (fix: --shmctl /path/to/bin/shmctl)"
case $shmctl in
    /*) ;;
    *) die "--shmctl must be an absolute path, not '$shmctl'" ;;
esac
# systemd reads % as a specifier and splits on spaces; sed would read & and |.
case $shmctl in
    *[!A-Za-z0-9._/+-]*) die "'$shmctl' has characters a unit file cannot carry unquoted (fix: a symlink with a plain path)" ;;
esac
[ -f "$shmctl" ] && [ -x "$shmctl" ] || die "'$shmctl' is not an executable file"

if [ -z "$from" ]; then
    here=$(cd "$(dirname "$0")" && pwd)
    if [ -d "$here/../deploy/systemd" ]; then
        from=$here/../deploy/systemd  # a checkout
    elif [ -d "$here/systemd" ]; then
        from=$here/systemd  # PREFIX/share/shmctl, as the wheel installs it
    else
        from=$(dirname "$(dirname "$shmctl")")/share/shmctl/systemd
    fi
fi
[ -d "$from" ] || die "no unit templates in '$from' (fix: --from DIR)"

mkdir -p "$dest"
installed=
for unit in "$from"/shmctl-*.service "$from"/shmctl-*.timer; do
    [ -f "$unit" ] || continue
    name=$(basename "$unit")
    # Write beside the target and rename, so systemd never reads a half-written unit.
    sed "s|^ExecStart=shmctl |ExecStart=$shmctl |" "$unit" >"$dest/.$name.tmp"
    chmod 0644 "$dest/.$name.tmp"
    mv -f "$dest/.$name.tmp" "$dest/$name"
    installed="$installed $name"
done
[ -n "$installed" ] || die "no shmctl-*.service or *.timer in '$from'"
echo "installed into $dest:$installed (ExecStart=$shmctl)"
echo "next: systemctl daemon-reload && systemctl enable --now shmctl-reap.timer shmctl-metrics.timer"
echo "  or, for reaping and metrics served continuously instead: systemctl enable --now shmctl-watch.service"
