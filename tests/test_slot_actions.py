"""POST /slots/{id}?action=save|restore|erase on the real server: a restored slot continues bitwise alike."""

from __future__ import annotations

import httpx
import pytest

from tests.servers import running_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from app.models.synth import tiny_model

    model = tiny_model(tmp_path_factory.mktemp("slots"), "llama", qtype="f16")
    save_dir = tmp_path_factory.mktemp("saves")
    with running_server("ours", model, ["-np", "2", "-c", "2048", "-t", "2", "--slot-save-path", str(save_dir)]) as b:
        yield b, save_dir


def complete(base, prompt, **kw):
    r = httpx.post(f"{base}/completion", json={"prompt": prompt, "n_predict": 8, "temperature": 0, "id_slot": 0,
                                               "return_tokens": True, **kw}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_save_erase_restore_round_trip(server):
    base, save_dir = server
    prompt = "hello world " * 20
    first = complete(base, prompt)
    r = httpx.post(f"{base}/slots/0?action=save", json={"filename": "s0.bin"})
    assert r.status_code == 200, r.text
    assert r.json()["n_saved"] > 0 and (save_dir / "s0.bin").exists()
    assert httpx.post(f"{base}/slots/0?action=erase").json()["n_erased"] == r.json()["n_saved"]
    r = httpx.post(f"{base}/slots/0?action=restore", json={"filename": "s0.bin"})
    assert r.status_code == 200, r.text
    again = complete(base, prompt)
    assert again["tokens"] == first["tokens"]
    assert again["timings"]["cache_n"] > 0  # the restored KV was reused, not recomputed


@pytest.mark.parametrize("name", ["../x", "a/b", "", ".hidden", "x\x00y"])
def test_bad_file_names_are_400(server, name):
    base, _ = server
    r = httpx.post(f"{base}/slots/0?action=save", json={"filename": name})
    assert r.status_code == 400, r.text


def test_corrupt_file_is_refused(server):
    base, save_dir = server
    complete(base, "some words " * 10)
    assert httpx.post(f"{base}/slots/0?action=save", json={"filename": "c.bin"}).status_code == 200
    data = bytearray((save_dir / "c.bin").read_bytes())
    data[-1] ^= 0xFF
    (save_dir / "c.bin").write_bytes(bytes(data))
    r = httpx.post(f"{base}/slots/0?action=restore", json={"filename": "c.bin"})
    assert r.status_code == 400 and "checksum" in r.json()["error"]["message"].lower()
    assert httpx.post(f"{base}/slots/9?action=erase").status_code == 400
    assert httpx.post(f"{base}/slots/0?action=restore", json={"filename": "missing.bin"}).status_code == 400
