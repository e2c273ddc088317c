"""deploy/install.sh and install.sh --user on a machine without python3-venv, with a venv an
earlier run left half-made, and with the extras they install (issue 4.7, first hour).

No Debian image can be pulled here, so most tests use the real Debian python3 with
`ensurepip` shadowed (what python3-venv provides), and a stand-in python that records
pip's arguments: the scripts run for real, as root under a scratch root and as a
throwaway user, and nothing is downloaded. One test runs install.sh in a real Debian
without python3-venv: the dev cluster's Debian 13 root file system, under an overlay.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.devcluster import REPO

INSTALL = REPO / "deploy" / "install.sh"
REAL_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable

# A python3 like Debian's without python3-venv: `import ensurepip` fails, and `-m venv`
# leaves half a venv (bin/python, no pip) and fails as Debian's does.
NO_VENV_PYTHON = f"""#!/bin/bash
if [ "$1" = -m ] && [ "$2" = venv ]; then
    shift 2
    {REAL_PYTHON} -m venv --without-pip "$@"
    echo "The virtual environment was not created successfully because ensurepip is not"
    echo "available.  On Debian/Ubuntu systems, you need to install the python3-venv package"
    exit 1
fi
PYTHONPATH="$FAKE_DIR/shadow" exec {REAL_PYTHON} "$@"
"""
# A python3 whose `-m venv DIR` makes a stand-in venv (its python records pip's arguments).
GOOD_PYTHON = f"""#!/bin/bash
if [ "$1" = -m ] && [ "$2" = venv ]; then
    shift 2
    echo "venv $*" >>"$FAKE_LOG"
    dir="${{*: -1}}"
    # Never write through what is there: a half-made venv's bin/python links to the
    # system's python3 (as --clear does, the old entries go first).
    rm -f "$dir/bin/python" "$dir/bin/python3" "$dir/bin/llmd-supervisor"
    mkdir -p "$dir/bin"
    echo "home = /fake" >"$dir/pyvenv.cfg"
    cp --remove-destination "$FAKE_DIR/venv-python" "$dir/bin/python"
    cp --remove-destination "$FAKE_DIR/venv-cli" "$dir/bin/llmd-supervisor"
    exit 0
fi
exec {REAL_PYTHON} "$@"
"""
VENV_PYTHON = """#!/bin/bash
if [ "$1" = -m ] && [ "$2" = pip ]; then
    [ "$3" = --version ] && exit 0
    shift 2
    echo "pip $*" >>"$FAKE_LOG"
    exit 0
fi
exit 3
"""
VENV_CLI = """#!/bin/bash
echo "llmd-supervisor 0.0.0-fake"
"""


@pytest.fixture
def fakes() -> Iterator[Path]:
    """The stand-in pythons, in a directory any user may read (a throwaway user runs them)."""
    d = Path(f"/tmp/llmd-fake-python-{uuid.uuid4().hex[:8]}")
    (d / "shadow").mkdir(parents=True)
    (d / "shadow" / "ensurepip.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'ensurepip'\")\n"
    )
    for name, text in (
        ("no-venv-python3", NO_VENV_PYTHON),
        ("python3", GOOD_PYTHON),
        ("venv-python", VENV_PYTHON),
        ("venv-cli", VENV_CLI),
    ):
        (d / name).write_text(text)
        (d / name).chmod(0o755)
    log = d / "calls.log"
    log.write_text("")
    log.chmod(0o666)
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _install(root: Path, fakes: Path, python: str, **env: str) -> subprocess.CompletedProcess[str]:
    if os.geteuid() != 0:
        pytest.fail("install.sh must run as root")
    full = {
        **os.environ,
        "DESTDIR": str(root),
        "LLMD_USER": "nobody-llmd-test",  # not created: DESTDIR without LLMD_CREATE_USER
        "PYTHON": str(fakes / python),
        "FAKE_DIR": str(fakes),
        "FAKE_LOG": str(fakes / "calls.log"),
        **env,
    }
    return subprocess.run(
        ["bash", str(INSTALL)], capture_output=True, text=True, env=full, timeout=120
    )


def test_install_sh_without_python3_venv_names_the_package_and_leaves_no_half_venv(
    tmp_path: Path, fakes: Path
) -> None:
    out = _install(tmp_path / "root", fakes, "no-venv-python3")
    assert out.returncode == 1, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert "cannot make a virtual environment" in last, out.stderr
    assert "python3-venv" in last and "apt-get install python3-venv" in last
    assert "Traceback" not in out.stderr and "ensurepip is not" not in out.stderr
    assert not (tmp_path / "root/opt/llmd-supervisor").exists()  # nothing half-made


def test_install_sh_makes_a_half_made_venv_again(tmp_path: Path, fakes: Path) -> None:
    root = tmp_path / "root"
    prefix = root / "opt/llmd-supervisor"
    # What `python3 -m venv` leaves on a Debian without python3-venv: bin/python, no pip.
    subprocess.run([REAL_PYTHON, "-m", "venv", "--without-pip", str(prefix)], check=True)
    assert (prefix / "bin/python").exists()
    refused = _install(root, fakes, "no-venv-python3")
    assert refused.returncode == 1 and "python3-venv" in refused.stderr  # not pip's error
    assert "No module named pip" not in refused.stderr

    out = _install(root, fakes, "python3")
    assert out.returncode == 0, out.stderr
    assert "has no pip (an earlier run stopped half-way); making it again" in out.stderr
    calls = (fakes / "calls.log").read_text().splitlines()
    assert calls[0] == f"venv --clear {prefix}"
    assert calls[1].startswith("pip install") and calls[1].endswith(f"{REPO}[report]")


@pytest.mark.parametrize(
    ("extras", "target"),
    [("report,postgresql", f"{REPO}[report,postgresql]"), ("", str(REPO))],
)
def test_install_sh_extras_knob(tmp_path: Path, fakes: Path, extras: str, target: str) -> None:
    out = _install(tmp_path / "root", fakes, "python3", LLMD_EXTRAS=extras)
    assert out.returncode == 0, out.stderr
    calls = (fakes / "calls.log").read_text().splitlines()
    assert calls[0] == f"venv {tmp_path / 'root/opt/llmd-supervisor'}"  # no --clear
    assert calls[1].split()[-1] == target


@pytest.fixture
def user(tmp_path: Path) -> Iterator[pwd.struct_passwd]:
    """A throwaway non-root user with a home of its own; removed afterwards."""
    if os.geteuid() != 0:
        pytest.fail("creating a user needs root")
    name = f"llmdu{uuid.uuid4().hex[:8]}"
    home = Path(f"/tmp/{name}-home")
    subprocess.run(
        ["useradd", "--create-home", "--home-dir", str(home), "--shell", "/bin/bash", name],
        check=True,
    )
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", "--remove", name], capture_output=True, check=False)
        shutil.rmtree(home, ignore_errors=True)


def _install_user(
    u: pwd.struct_passwd, fakes: Path, python: str
) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": u.pw_dir,
        "USER": u.pw_name,
        "PYTHON": str(fakes / python),
        "FAKE_DIR": str(fakes),
        "FAKE_LOG": str(fakes / "calls.log"),
    }
    argv = ["setpriv", f"--reuid={u.pw_uid}", f"--regid={u.pw_gid}", "--init-groups"]
    return subprocess.run(
        [*argv, "bash", str(INSTALL), "--user"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=u.pw_dir,
    )


def test_install_user_installs_the_report_extra_and_names_python3_venv(
    fakes: Path, user: pwd.struct_passwd
) -> None:
    refused = _install_user(user, fakes, "no-venv-python3")
    assert refused.returncode == 1, refused.stderr
    assert "ask the machine's administrator to install python3-venv" in refused.stderr
    assert "Traceback" not in refused.stderr

    out = _install_user(user, fakes, "python3")
    assert out.returncode == 0, out.stderr
    calls = (fakes / "calls.log").read_text().splitlines()
    prefix = Path(user.pw_dir) / ".local/share/llmd-supervisor/venv"
    assert calls[0] == f"venv {prefix}"
    assert calls[1].split()[-1] == f"{REPO}[report]"  # `report` works, as the README says


# A real Debian without python3-venv: the dev cluster's Slurm 24.11 root file system
# (Debian 13, built by deploy/install-dev.sh; python3 without ensurepip), seen through an
# overlay in a private mount namespace so that nothing of it changes.
ROOTFS_GLOB = "/var/cache/llmd-devcluster/rootfs-24.11-*"
IN_DEBIAN = r"""
set -eu
root=$1 repo=$2 work=$3
mkdir -p "$work/up" "$work/work" "$work/m"
mount -t overlay overlay -o "lowerdir=$root,upperdir=$work/up,workdir=$work/work" "$work/m"
mkdir -p "$work/m/src" "$work/m/.llmd-host-etc"
mount --bind -o ro "$repo" "$work/m/src"
mount --bind -o ro /etc "$work/m/.llmd-host-etc"  # the rootfs's passwd, group... link there
mount -t proc proc "$work/m/proc"
set +e
chroot "$work/m" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root DESTDIR=/tmp/dest \
    bash /src/deploy/install.sh
echo "rc=$?"
ls -A "$work/m/tmp/dest/opt/llmd-supervisor" 2>/dev/null | sed 's/^/left: /'
"""


def test_install_sh_on_a_real_debian_without_python3_venv_names_the_package(
    tmp_path: Path,
) -> None:
    roots = sorted(Path("/").glob(ROOTFS_GLOB.lstrip("/")))
    if os.geteuid() != 0 or not roots:
        pytest.fail(
            "this test needs root and the dev cluster's Slurm 24.11 root file system "
            f"({ROOTFS_GLOB}); deploy/install-dev.sh builds it"
        )
    root = roots[0]
    assert not list(root.glob("usr/lib/python3*/ensurepip")), "this rootfs has python3-venv"
    done = subprocess.run(
        [
            *("unshare", "--mount", "--propagation", "private"),
            *("bash", "-c", IN_DEBIAN, "in-debian", str(root), str(REPO), str(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    out = done.stdout + done.stderr
    assert "rc=1" in done.stdout, out
    assert "cannot make a virtual environment" in done.stderr, out
    assert "python3-venv" in done.stderr and "apt-get install python3-venv" in done.stderr, out
    assert "left:" not in done.stdout, out  # no half-made venv
    assert "Traceback" not in out, out
