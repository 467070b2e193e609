"""Real shells find the completions where pip installs them, and complete with them.

The wheel puts ``PREFIX/share/bash-completion/completions/shmctl`` where bash-completion loads it
on the first Tab, and ``PREFIX/share/zsh/site-functions/_shmctl`` where zsh's compinit registers
it. What an operator adds for each kind of install is what docs/install.md says, and each test
does exactly that and no more:

- a venv, or pipx (a venv, and a symlink to its ``bin/shmctl`` on ``PATH``): bash-completion
  before 2.12 looks only in ``$XDG_DATA_DIRS``, so ``VENV/share`` goes there; 2.12 and later
  also look beside the command found on ``PATH`` (through the symlink). zsh: ``VENV/share/
  zsh/site-functions`` on ``$fpath`` before ``compinit``.
- a system-wide install (``--prefix /usr/local``, a root pip on Debian or the python image):
  nothing; both shells look there by default. The install is laid over ``/usr/local`` in a
  mount namespace of the test's own (needs root), so the host's ``/usr/local`` is untouched.

Before all of that, docs/install.md leads with what needs no search path at all: ``source <(shmctl
completion bash)``, ``shmctl completion zsh > "${fpath[1]}/_shmctl"``, ``shmctl completion fish |
source`` and ``shmctl man | man -l -``, run from the venv's ``bin`` or pipx's link; the last
section tests those, and where ``man`` finds the page of a venv or of pipx.

The wheel is installed with no index: into a venv created without pip (the pip running these
tests installs into it), whose dependencies come from this interpreter's site-packages through a
``.pth`` file, so the tests need no network. Every shell runs with an empty ``HOME`` and a
minimal environment, so nothing of the host's shell configuration takes part.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import typer.main

from shmctl.app import app
from tests.system.test_packaging import build_wheel

BASH_COMPLETION = Path("/usr/share/bash-completion/bash_completion")
USR_LOCAL = Path("/usr/local")

#: Sources bash-completion, has it load shmctl's completion as the first Tab would (2.12 renamed
#: __load_completion to _comp_load), then calls the function loaded as bash would for
#: ``shmctl <Tab>``.
BASH_TAB = r"""
. "$1" || exit 90
printf 'VERSION %s.%s\n' "${BASH_COMPLETION_VERSINFO[0]}" "${BASH_COMPLETION_VERSINFO[1]}"
if declare -F _comp_load >/dev/null; then _comp_load shmctl; else __load_completion shmctl; fi
spec=$(complete -p shmctl 2>/dev/null) || exit 0
printf 'SPEC %s\n' "$spec"
function=${spec##*-F }; function=${function%% *}
COMP_WORDS=(shmctl ""); COMP_CWORD=1; COMP_LINE="shmctl "; COMP_POINT=${#COMP_LINE}
"$function" shmctl "" shmctl
printf 'REPLY %s\n' "${COMPREPLY[@]}"
"""

#: compinit with the directories given first on $fpath, then the function registered for shmctl
#: called once, as the first Tab of ``shmctl <Tab>`` calls it; _arguments and _files, which only
#: work inside a Tab, are stand-ins that print what the function would offer.
ZSH_TAB = r"""
fpath=("$@" $fpath)
autoload -Uz compinit && compinit -D
print -r -- "COMPS ${_comps[shmctl]-}"
[[ -n ${_comps[shmctl]-} ]] || exit 0
_arguments() { print -r -- "ARGUMENTS $*" }
_files() { print -r -- "FILES" }
words=(shmctl "") CURRENT=2
$_comps[shmctl]
"""


@dataclass(frozen=True)
class Tab:
    """What a shell did with ``shmctl <Tab>``."""

    loaded: str  # the compspec (bash) or function (zsh) registered for shmctl; "" when none
    offered: list[str]  # the words it would complete
    version: tuple[int, int] | None = None  # bash-completion's


def commands() -> list[str]:
    root: Any = typer.main.get_command(app)
    return list(root.commands)


def needs(program: str) -> None:
    if program == "bash-completion" and not BASH_COMPLETION.is_file():
        pytest.skip(
            f"bash-completion is not installed ({BASH_COMPLETION}; Debian: apt-get install bash-completion)"
        )
    if program != "bash-completion" and shutil.which(program) is None:
        pytest.skip(f"{program} is not installed")


def clean_env(home: Path, path: list[Path], **extra: str) -> dict[str, str]:
    """A login's bare environment: this HOME, this PATH before the system's, nothing inherited."""
    return {
        "HOME": str(home),
        "PATH": os.pathsep.join([*map(str, path), "/usr/bin", "/bin"]),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        **extra,
    }


def run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120, check=False
    )


def bash_tab(env: dict[str, str], prefix: list[str] | None = None) -> Tab:
    done = run(
        [*(prefix or []), "bash", "--norc", "--noprofile", "-c", BASH_TAB, "bash", str(BASH_COMPLETION)], env
    )
    assert done.returncode == 0, done.stdout + done.stderr
    fields = [line.partition(" ")[::2] for line in done.stdout.splitlines()]
    major, minor = next(value for key, value in fields if key == "VERSION").split(".")
    return Tab(
        loaded=next((value for key, value in fields if key == "SPEC"), ""),
        offered=[value for key, value in fields if key == "REPLY" and value],
        version=(int(major), int(minor)),
    )


def zsh_tab(env: dict[str, str], fpath: list[Path], prefix: list[str] | None = None) -> Tab:
    done = run([*(prefix or []), "zsh", "-f", "-c", ZSH_TAB, "zsh", *map(str, fpath)], env)
    assert done.returncode == 0, done.stdout + done.stderr
    loaded = next(
        line.removeprefix("COMPS ") for line in done.stdout.splitlines() if line.startswith("COMPS ")
    )
    # typer's answer, one line once eval has split it: _arguments *: :(("scan":"help..." "reap":...))
    offered = re.findall(r'(?:\(\(| )"([a-z][a-z0-9-]*)":"', done.stdout)
    return Tab(loaded=loaded.strip(), offered=offered)


# ------------------------------------------------------------------------------ installs


@dataclass(frozen=True)
class Install:
    venv: Path  # where pip put shmctl: PIPX_HOME/venvs/shmctl, pipx's layout
    pipx_bin: Path  # PIPX_BIN_DIR: a symlink to venv/bin/shmctl, as pipx makes it

    def path(self, kind: str) -> Path:
        """The directory on PATH that holds the shmctl a user of this kind of install runs."""
        return self.venv / "bin" if kind == "venv" else self.pipx_bin


def pip_install(python: Path, wheel: Path, *options: str) -> None:
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index"]
    done = subprocess.run(
        [*pip, *options, str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))[0]


@pytest.fixture(scope="module")
def install(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Install:
    pipx = tmp_path_factory.mktemp("pipx")
    prefix, pipx_bin = pipx / "venvs" / "shmctl", pipx / "bin"
    venv.create(prefix, with_pip=False, symlinks=True)
    pip_install(prefix / "bin" / "python", wheel)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(prefix), "platbase": str(prefix)}))
    # typer, rich and prometheus-client from the interpreter running the tests; shmctl itself
    # from the venv, whose site-packages comes first.
    deps = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    (site / "test-dependencies.pth").write_text("".join(f"{d}\n" for d in sorted(deps)))
    pipx_bin.mkdir()
    (pipx_bin / "shmctl").symlink_to(prefix / "bin" / "shmctl")
    return Install(venv=prefix, pipx_bin=pipx_bin)


@pytest.fixture(scope="module")
def usr_local(install: Install, wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What ``pip install --prefix /usr/local`` writes, under a root of its own (``--root``)."""
    root = tmp_path_factory.mktemp("system")
    pip_install(
        install.venv / "bin" / "python",
        wheel,
        "--ignore-installed",
        "--root",
        str(root),
        "--prefix",
        str(USR_LOCAL),
    )
    return root


def in_usr_local(root: Path) -> list[str]:
    """A command prefix: run in a mount namespace where ``root``'s /usr/local lies over the host's."""
    if os.geteuid() != 0 or shutil.which("unshare") is None or not USR_LOCAL.is_dir():
        pytest.skip("needs root, unshare(1) and a /usr/local to lay the install over")
    # A read-only overlay (two lower layers, no upper): the host's /usr/local shows through.
    lay = 'mount -t overlay overlay -o "lowerdir=$1$2:$2" "$2" || exit 97; shift 2; exec "$@"'
    prefix = [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        lay,
        "sh",
        str(root),
        str(USR_LOCAL),
    ]
    probe = run([*prefix, "true"], {})
    if probe.returncode == 97:
        pytest.skip(f"cannot lay an overlay over /usr/local here: {probe.stderr.strip()}")
    assert probe.returncode == 0, probe.stderr
    return prefix


# ---------------------------------------------------------------------------------- bash


@pytest.mark.parametrize("kind", ["venv", "pipx"])
def test_bash_completion_loads_a_venv_install_whose_share_is_on_xdg_data_dirs(
    install: Install, tmp_path: Path, kind: str
) -> None:
    needs("bash-completion")
    data_dirs = f"{install.venv / 'share'}:/usr/local/share:/usr/share"
    tab = bash_tab(clean_env(tmp_path, [install.path(kind)], XDG_DATA_DIRS=data_dirs))
    assert tab.loaded == "complete -o default -F _shmctl_completion shmctl"
    assert tab.offered == commands()


@pytest.mark.parametrize("kind", ["venv", "pipx"])
def test_without_xdg_data_dirs_bash_completion_finds_a_venv_install_from_2_12_on(
    install: Install, tmp_path: Path, kind: str
) -> None:
    # 2.12 added the lookup beside the command on PATH, symlinks resolved (scop/bash-completion#696).
    needs("bash-completion")
    tab = bash_tab(clean_env(tmp_path, [install.path(kind)]))
    assert tab.version is not None
    if tab.version >= (2, 12):
        assert tab.offered == commands()
    else:
        assert (tab.loaded, tab.offered) == ("", [])


def test_bash_completion_loads_a_system_install_with_nothing_added(usr_local: Path, tmp_path: Path) -> None:
    needs("bash-completion")
    prefix = in_usr_local(usr_local)
    tab = bash_tab(clean_env(tmp_path, [USR_LOCAL / "bin"]), prefix)
    assert tab.loaded == "complete -o default -F _shmctl_completion shmctl"
    assert tab.offered == commands()


def test_install_completion_bash_writes_where_an_interactive_bash_reads(
    install: Install, tmp_path: Path
) -> None:
    needs("bash")
    env = clean_env(tmp_path, [install.venv / "bin"])
    # Run from the shell it is for: typer asks the process tree which shell that is.
    done = run(["bash", "--norc", "--noprofile", "-c", "shmctl --install-completion; :"], env)
    assert done.returncode == 0, done.stdout + done.stderr
    shell = run(["bash", "-i", "-c", "complete -p shmctl"], env)
    assert shell.stdout.strip() == "complete -o default -F _shmctl_completion shmctl", shell.stderr


# ----------------------------------------------------------------------------------- zsh


def test_zsh_registers_the_venvs_function_file_and_its_first_call_completes(
    install: Install, tmp_path: Path
) -> None:
    needs("zsh")
    fpath = [install.venv / "share" / "zsh" / "site-functions"]
    tab = zsh_tab(clean_env(tmp_path, [install.venv / "bin"]), fpath)
    assert tab.loaded == "_shmctl"
    assert tab.offered == commands()


def test_zsh_finds_a_system_install_with_nothing_added(usr_local: Path, tmp_path: Path) -> None:
    needs("zsh")
    site_functions = USR_LOCAL / "share" / "zsh" / "site-functions"
    default_fpath = run(["zsh", "-f", "-c", "print -rl -- $fpath"], clean_env(tmp_path, []))
    if str(site_functions) not in default_fpath.stdout.splitlines():
        pytest.skip(f"this zsh does not look in {site_functions} by default")
    tab = zsh_tab(clean_env(tmp_path, [USR_LOCAL / "bin"]), [], in_usr_local(usr_local))
    assert tab.loaded == "_shmctl"
    assert tab.offered == commands()


def test_install_completion_zsh_writes_where_an_interactive_zsh_reads(
    install: Install, tmp_path: Path
) -> None:
    # typer writes its own script as ~/.zfunc/_shmctl; it binds on the first Tab and completes
    # from the second (docs/install.md), which is why the wheel ships completions/_shmctl.
    needs("zsh")
    env = clean_env(tmp_path, [install.venv / "bin"])
    done = run(["zsh", "-f", "-c", "shmctl --install-completion; :"], env)
    assert done.returncode == 0, done.stdout + done.stderr
    shell = run(["zsh", "-i", "-c", 'print -r -- "COMPS ${_comps[shmctl]-}"'], env)
    assert "COMPS _shmctl" in shell.stdout.splitlines(), shell.stdout + shell.stderr


# ------------------------------------------------ shmctl completion, shmctl man: any install
#
# What docs/install.md leads with, for every install path: the script and the page come from
# the shmctl on PATH, wherever its venv lives, so nothing is added to any search path.

#: docs/install.md's lines, as written there; each is run below as a user would run it.
BASHRC_LINE = "source <(shmctl completion bash)"
ZSHRC_LINE = "source <(shmctl completion zsh)"
ZFUNC_LINE = "mkdir -p ~/.zfunc && shmctl completion zsh > ~/.zfunc/_shmctl"
ROOT_FPATH_LINE = 'shmctl completion zsh > "${fpath[1]}/_shmctl"'
FISH_LINE = "shmctl completion fish | source"
MAN_LINE = "shmctl man | man -l -"
PIPX_MAN_LINE = "mkdir -p ~/.local/share/man/man1 && shmctl man > ~/.local/share/man/man1/shmctl.1"
DOCUMENTED = (BASHRC_LINE, ZSHRC_LINE, ZFUNC_LINE, ROOT_FPATH_LINE, FISH_LINE, MAN_LINE, PIPX_MAN_LINE)


def test_the_lines_run_here_are_the_ones_docs_install_md_gives() -> None:
    text = " ".join((Path(__file__).resolve().parents[2] / "docs" / "install.md").read_text().split())
    assert [line for line in DOCUMENTED if line not in text] == []


#: bash-completion, then the script `shmctl completion bash` prints, then its function called as
#: bash calls it for each line given (one per argument, the word under the cursor last).
BASH_SOURCED = r"""
. "$1" || exit 90
shift
source <(shmctl completion bash) || exit 91
printf 'SPEC %s\n' "$(complete -p shmctl)"
for line in "$@"; do
  read -ra COMP_WORDS <<<"$line"
  [[ $line == *" " ]] && COMP_WORDS+=("")
  COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 )); COMP_LINE=$line; COMP_POINT=${#line}; COMPREPLY=()
  _shmctl_completion shmctl "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD-1]}"
  printf 'REPLY %s\n' "${COMPREPLY[*]}"
done
"""

#: compinit with the given directory first on $fpath, then the function registered for shmctl
#: called for ``shmctl <Tab>`` and ``shmctl completion <Tab>``; _arguments stands in as above.
ZSH_FPATH = r"""
fpath=("$1" $fpath)
autoload -Uz compinit && compinit -D
print -r -- "COMPS ${_comps[shmctl]-}"
_arguments() { print -r -- "ARGUMENTS $*" }
words=(shmctl "") CURRENT=2
$_comps[shmctl]
words=(shmctl completion "") CURRENT=3
$_comps[shmctl]
"""


def zsh_offers(stdout: str) -> list[list[str]]:
    """The words each call of the function offered: ``_arguments *: :(("scan":"help" ...))``."""
    return [
        re.findall(r'(?:\(\(| )"([a-z][a-z0-9-]*)"', line)
        for line in stdout.splitlines()
        if line.startswith("ARGUMENTS ")
    ]


SHELLS = ["bash", "zsh", "fish"]


@pytest.mark.parametrize("kind", ["venv", "pipx"])
def test_bash_completes_with_the_script_shmctl_completion_prints(
    install: Install, tmp_path: Path, kind: str
) -> None:
    needs("bash-completion")
    env = clean_env(tmp_path, [install.path(kind)])  # no XDG_DATA_DIRS: nothing points at the venv
    argv = ["bash", "--norc", "--noprofile", "-c", BASH_SOURCED, "bash", str(BASH_COMPLETION)]
    done = run([*argv, "shmctl ", "shmctl completion ", "shmctl completion z"], env)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "SPEC complete -o default -F _shmctl_completion shmctl"
    assert lines[1:] == [f"REPLY {' '.join(commands())}", "REPLY bash zsh fish", "REPLY zsh"]


def test_an_interactive_bash_with_the_docs_bashrc_line_completes_shmctl(
    install: Install, tmp_path: Path
) -> None:
    needs("bash")
    (tmp_path / ".bashrc").write_text(BASHRC_LINE + "\n")
    shell = run(["bash", "-i", "-c", "complete -p shmctl"], clean_env(tmp_path, [install.pipx_bin]))
    assert shell.stdout.strip() == "complete -o default -F _shmctl_completion shmctl", shell.stderr


@pytest.mark.parametrize("kind", ["venv", "pipx"])
@pytest.mark.parametrize("line", [ZFUNC_LINE, ROOT_FPATH_LINE], ids=["zfunc", "fpath1"])
def test_zsh_autoloads_the_file_shmctl_completion_writes_to_fpath_and_completes(
    install: Install, tmp_path: Path, kind: str, line: str
) -> None:
    needs("zsh")
    env = clean_env(tmp_path, [install.path(kind)])
    site_functions = tmp_path / ".zfunc"
    if line == ROOT_FPATH_LINE:  # the first directory of $fpath: a root's, here one of the test's
        site_functions = tmp_path / "site-functions"
        site_functions.mkdir()
    written = run(["zsh", "-f", "-c", f'fpath=("$1" $fpath); {line}', "zsh", str(site_functions)], env)
    assert written.returncode == 0, written.stderr
    done = run(["zsh", "-f", "-c", ZSH_FPATH, "zsh", str(site_functions)], env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "COMPS _shmctl" in done.stdout.splitlines()
    assert zsh_offers(done.stdout) == [commands(), SHELLS]


def test_zsh_completes_with_the_script_sourced_after_compinit(install: Install, tmp_path: Path) -> None:
    needs("zsh")
    sourced = (
        "autoload -Uz compinit && compinit -D\n"
        + ZSHRC_LINE
        + r""" || exit 91
print -r -- "COMPS ${_comps[shmctl]-}"
_arguments() { print -r -- "ARGUMENTS $*" }
words=(shmctl "") CURRENT=2
$_comps[shmctl]
"""
    )
    done = run(["zsh", "-f", "-c", sourced], clean_env(tmp_path, [install.pipx_bin]))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "COMPS _shmctl_completion" in done.stdout.splitlines()
    assert zsh_offers(done.stdout) == [commands()]


def test_fish_completes_with_the_script_shmctl_completion_prints(install: Install, tmp_path: Path) -> None:
    needs("fish")
    script = (
        "shmctl completion fish | source; complete -C 'shmctl '; echo END; complete -C 'shmctl completion '"
    )
    done = run(["fish", "--no-config", "-c", script], clean_env(tmp_path, [install.pipx_bin]))
    assert done.returncode == 0, done.stdout + done.stderr
    first, _, second = done.stdout.partition("END\n")
    assert [line.split("\t")[0] for line in first.splitlines()] == commands()
    assert [line.split("\t")[0] for line in second.splitlines()] == SHELLS


def rendered_man_page(install: Install, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``shmctl man | man -l -`` from the pipx link, as docs/install.md has it."""
    needs("man")
    env = clean_env(tmp_path, [install.pipx_bin], MANPAGER="cat", MANWIDTH="100")
    return run(["bash", "-c", f"set -o pipefail; {MAN_LINE.replace('man -l', 'man --warnings -l')}"], env)


def test_shmctl_man_piped_to_man_renders_the_page_with_every_command(
    install: Install, tmp_path: Path
) -> None:
    done = rendered_man_page(install, tmp_path)
    assert (done.returncode, done.stderr) == (0, "")
    assert "NAME\n       shmctl - find, explain and safely reap" in done.stdout
    for name in commands():
        assert f"\n       shmctl {name}\n" in done.stdout, name  # the DESCRIPTION's list
        assert f"\n   shmctl {name} [OPTIONS]" in done.stdout, name  # its section under COMMANDS


def test_shmctl_man_prints_the_page_the_wheel_installs(install: Install, tmp_path: Path) -> None:
    done = run(["shmctl", "man"], clean_env(tmp_path, [install.pipx_bin]))
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == (install.venv / "share" / "man" / "man1" / "shmctl.1").read_text()


def test_man_finds_the_page_of_a_venv_whose_bin_is_on_path(install: Install, tmp_path: Path) -> None:
    # man-db looks in BIN/../share/man for each BIN on PATH: a venv's bin, not pipx's link.
    needs("man")
    done = run(["man", "-w", "shmctl"], clean_env(tmp_path, [install.venv / "bin"]))
    assert done.stdout.strip() == str(install.venv / "share" / "man" / "man1" / "shmctl.1"), done.stderr


def test_for_pipx_the_page_shmctl_man_writes_to_local_share_man_is_found(
    install: Install, tmp_path: Path
) -> None:
    needs("man")
    local_bin = tmp_path / ".local" / "bin"  # pipx's PIPX_BIN_DIR, with its link to the venv
    local_bin.mkdir(parents=True)
    (local_bin / "shmctl").symlink_to(install.venv / "bin" / "shmctl")
    env = clean_env(tmp_path, [local_bin])
    # docs/install.md's lines for pipx, as written there
    lines = "mkdir -p ~/.local/share/man/man1 && shmctl man > ~/.local/share/man/man1/shmctl.1"
    assert run(["bash", "-c", lines], env).returncode == 0
    done = run(["man", "-w", "shmctl"], env)
    assert done.stdout.strip() == str(tmp_path / ".local" / "share" / "man" / "man1" / "shmctl.1"), (
        done.stderr
    )
