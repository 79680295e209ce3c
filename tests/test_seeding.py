"""The environment's seed comes from the trainer's seed through a key only the host holds."""
from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from karotte import seeding
from karotte.episode import Episode

from envs.basic import Addition, Doubler

KEY = "k" * 32


def test_the_same_key_and_seed_give_the_same_environment_seed():
    assert seeding.env_seed(Addition(), 7, KEY) == seeding.env_seed(Addition(), 7, KEY)


def test_another_key_another_seed_or_another_environment_give_another_environment_seed():
    base = seeding.env_seed(Addition(), 7, KEY)
    assert seeding.env_seed(Addition(), 7, "j" * 32) != base
    assert seeding.env_seed(Addition(), 8, KEY) != base
    assert seeding.env_seed(Doubler(), 7, KEY) != base


def test_the_environment_seed_is_63_bits_and_never_the_trainers():
    seeds = [seeding.env_seed(Addition(), s, KEY) for s in range(200)]
    assert all(0 <= s < 2 ** 63 for s in seeds)
    assert len(set(seeds)) == 200
    assert max(seeds) > 2 ** 62  # all 63 bits are used: no small numbers to try one by one


@pytest.mark.parametrize("key", ["short", b"", b"x" * 15])
def test_a_key_too_short_to_be_secret_is_refused_with_the_fix(key):
    with pytest.raises(seeding.EpisodeKeyError, match="at least 16 are needed.*token_hex"):
        seeding.env_seed(Addition(), 1, key)


def test_a_seed_that_is_not_an_integer_is_refused_when_the_episode_is_made():
    for bad in ("7", 7.0, None, True):
        with pytest.raises(TypeError, match="seed must be an int"):
            Episode(Addition(), seed=bad, key=KEY)


def test_the_environment_gets_the_derived_seed_and_the_trainer_keeps_its_own():
    seen = []

    class Spy(Addition):
        def prompt(self, seed):
            seen.append(seed)
            return super().prompt(seed)

    with Episode(Spy(), seed=3, key=KEY) as ep:
        ep.reset()
        assert ep.seed == 3
    assert seen == [seeding.env_seed(Spy(), 3, KEY)]


def _key_in_fresh_process(env: dict) -> str:
    code = "from karotte import seeding; print(seeding.host_key().decode())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_without_a_key_the_host_makes_one_file_of_mode_0600_that_every_process_reads(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (seeding.KEY_ENV, seeding.KEY_FILE_ENV)}
    env["XDG_CONFIG_HOME"] = str(tmp_path)
    first = _key_in_fresh_process(env)
    path = tmp_path / "karotte" / "episode-key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(first) == 64
    assert _key_in_fresh_process(env) == first


def test_processes_that_make_the_key_at_once_agree_on_one(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (seeding.KEY_ENV, seeding.KEY_FILE_ENV)}
    env["XDG_CONFIG_HOME"] = str(tmp_path)
    code = "from karotte import seeding; print(seeding.host_key().decode())"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              text=True) for _ in range(8)]
    keys = {p.communicate()[0].strip() for p in procs}
    assert len(keys) == 1
    assert sorted(os.listdir(tmp_path / "karotte")) == ["episode-key"]


def test_karotte_key_in_the_environment_wins_over_the_file(tmp_path):
    env = dict(os.environ, XDG_CONFIG_HOME=str(tmp_path), KAROTTE_KEY=KEY)
    assert _key_in_fresh_process(env) == KEY
    assert not (tmp_path / "karotte").exists()


def test_a_key_file_that_cannot_be_made_gives_a_process_key_and_a_warning(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the directory would go
    env = {k: v for k, v in os.environ.items() if k not in (seeding.KEY_ENV, seeding.KEY_FILE_ENV)}
    env["KAROTTE_KEY_FILE"] = str(blocked / "episode-key")
    code = ("import warnings; warnings.simplefilter('error'); from karotte import seeding\n"
            "try:\n    seeding.host_key()\nexcept RuntimeWarning as w:\n    print(w)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert "not reproducible" in out and "KAROTTE_KEY" in out


def test_the_agent_cannot_read_the_hosts_key_file(tmp_path, monkeypatch):
    monkeypatch.delenv(seeding.KEY_ENV, raising=False)
    monkeypatch.setenv(seeding.KEY_FILE_ENV, str(tmp_path / "episode-key"))
    key = seeding.host_key().decode()
    with Episode(Addition(), seed=1) as ep:
        ep.reset()
        r = ep.exec(f"cat {tmp_path}/episode-key; grep -rs {key} /etc /home /tmp /workspace")
    assert r.exit_code != 0 and key not in r.text
