"""The peer key file: made once with mode 0600, the same identity at every start, refused
(with a message saying what to do) when others may read it or it holds no Ed25519 key."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from moshpitd.identity import (
    IdentityError,
    KeyFileLock,
    PeerKey,
    default_key_file,
    peer_id_of,
    verify,
)


def test_key_file_is_made_private_once_and_then_kept(tmp_path: Path) -> None:
    path = tmp_path / "state" / "peer.key"
    first = PeerKey.load_or_create(str(path))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    again = PeerKey.load_or_create(str(path))
    assert again.peer_id == first.peer_id and again.public == first.public
    assert PeerKey.load(str(path)).peer_id == first.peer_id


def test_peer_id_is_the_hash_of_the_public_key_and_signatures_verify() -> None:
    key, other = PeerKey.generate(), PeerKey.generate()
    assert key.peer_id == hashlib.sha256(key.public).digest()[:20] == peer_id_of(key.public)
    assert len(key.public) == 32 and key.peer_id != other.peer_id
    signature = key.sign(b"record")
    assert verify(key.public, signature, b"record")
    assert not verify(key.public, signature, b"recorD")
    assert not verify(other.public, signature, b"record")
    assert not verify(b"\x00" * 31, signature, b"record")


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_a_key_others_may_read_is_refused(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "peer.key"
    PeerKey.load_or_create(str(path))
    path.chmod(mode)
    with pytest.raises(IdentityError, match=r"readable by its owner only \(chmod 600"):
        PeerKey.load_or_create(str(path))


@pytest.mark.parametrize("content", [
    b"", b"not a key\n", b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
    bytes(range(7, 256, 3))[:64]], ids=["empty", "text", "bad-pem", "binary"])
def test_a_malformed_key_is_refused_and_left_alone(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "peer.key"
    path.write_bytes(content)
    path.chmod(0o600)
    with pytest.raises(IdentityError, match="does not hold an unencrypted PEM private key"):
        PeerKey.load_or_create(str(path))
    assert path.read_bytes() == content  # never overwritten: it may be someone's identity


def test_a_key_of_another_kind_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "peer.key"
    path.write_bytes(ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    path.chmod(0o600)
    with pytest.raises(IdentityError, match="not an Ed25519 key"):
        PeerKey.load(str(path))


def test_links_and_unwritable_places_are_refused(tmp_path: Path) -> None:
    real = tmp_path / "real.key"
    PeerKey.load_or_create(str(real))
    link = tmp_path / "link.key"
    link.symlink_to(real)
    with pytest.raises(IdentityError, match="cannot read peer key file"):
        PeerKey.load_or_create(str(link))
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(IdentityError, match=r"cannot create peer key file .*set peer_key_file"):
        PeerKey.load_or_create(str(blocker / "peer.key"))


def test_the_daemon_refuses_a_bad_key_file_at_start(tmp_path: Path) -> None:
    loose = tmp_path / "loose.key"
    PeerKey.load_or_create(str(loose))
    loose.chmod(0o644)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOSHPITD_")}
    for args in (["--check-config"], ["--ipc-socket", str(tmp_path / "d.sock")]):
        out = subprocess.run([sys.executable, "-m", "moshpitd", *args, "--peer-key-file",
                              str(loose)], capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 2, out.stderr
        assert "moshpitd: peer key: peer key file" in out.stderr and "chmod 600" in out.stderr
    fresh = tmp_path / "fresh.key"
    out = subprocess.run([sys.executable, "-m", "moshpitd", "--check-config", "--peer-key-file",
                          str(fresh)], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0 and not fresh.exists()  # checking makes nothing


@pytest.mark.parametrize(("env", "system_writable", "expected"), [
    ({"STATE_DIRECTORY": "/var/lib/moshpitd:/var/lib/other", "HOME": "/home/u"}, True,
     "/var/lib/moshpitd/peer.key"),
    ({"STATE_DIRECTORY": "/srv/state", "HOME": "/home/u"}, False, "/srv/state/peer.key"),
    ({"HOME": "/home/u"}, True, "{system}/peer.key"),
    ({"HOME": "/home/u", "XDG_STATE_HOME": "/x/state"}, False, "/x/state/moshpitd/peer.key"),
    ({"HOME": "/home/u"}, False, "/home/u/.local/state/moshpitd/peer.key"),
])
def test_default_key_file_suits_who_runs_the_daemon(
        env: dict[str, str], system_writable: bool, expected: str) -> None:
    system = "/var/lib/moshpitd"
    seen: list[str] = []

    def may_write(path: str) -> bool:
        seen.append(path)
        return system_writable

    assert default_key_file(env, system, may_write) == expected.format(system=system)
    assert seen in ([], [system])  # only the system directory is ever tested


def test_the_system_directory_is_writable_where_it_or_its_parent_is(tmp_path: Path) -> None:
    missing = tmp_path / "moshpitd"  # root makes /var/lib/moshpitd at first start
    assert default_key_file({"HOME": "/h"}, str(missing)) == str(missing / "peer.key")
    assert default_key_file({"HOME": "/h"}, str(tmp_path / "no" / "such" / "dir")) == (
        "/h/.local/state/moshpitd/peer.key")


def test_a_locked_key_file_names_its_holder(tmp_path: Path) -> None:
    path = tmp_path / "peer.key"
    PeerKey.load_or_create(str(path))
    holder = subprocess.Popen(  # another process holding the lock, as a running daemon does
        [sys.executable, "-c", "import sys; from moshpitd.identity import KeyFileLock; "
         "lock = KeyFileLock(sys.argv[1]); print('held', flush=True); sys.stdin.read()",
         str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(IdentityError, match=f"{path} is in use by another running daemon "
                           rf"\(pid {holder.pid}\)"):
            KeyFileLock(str(path))
    finally:
        holder.communicate("", timeout=10)
    KeyFileLock(str(path)).release()  # free once the holder is gone
