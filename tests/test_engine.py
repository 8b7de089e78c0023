"""The engine binding on a tiny synthetic llama: tokenizer, decode, batching, state, memory ops, views,
the GIL, samplers (host and backend), BatchExt, devices and log routing."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest

try:
    from test_engine_support import (  # noqa: F401 - fixtures
        bpe_vocab_path, engine, greedy_run, make_ctx, model, model_dir, tiny_path)
except ImportError:  # tests/ imported as a package
    from tests.test_engine_support import (  # noqa: F401 - fixtures
        bpe_vocab_path, engine, greedy_run, make_ctx, model, model_dir, tiny_path)

PROMPTS = ["Hello world, this is", "The capital of France", "1 2 3 4 5", "Once upon a time there"]


# -- tokenizer ---------------------------------------------------------------------------------------

def test_tokenize_detokenize_round_trip(model):
    v = model.vocab
    for text in ["Hello world!", "  leading spaces and\ttabs\nnewlines", "日本語のテキスト", "naïve café 🎉🚀"]:
        toks = v.tokenize(text, add_special=False)
        assert toks and all(0 <= t < v.n_tokens for t in toks)
        assert v.detokenize(toks) == text
    with_bos = v.tokenize("Hi", add_special=True)
    assert with_bos[0] == v.bos and v.add_bos
    bos_text = v.piece(v.bos, special=True).decode()
    assert v.detokenize(with_bos, unparse_special=True).startswith(bos_text)
    # (SPM: the space prefix is dropped only when the text starts the token list)
    assert v.detokenize(with_bos, remove_special=True).strip() == "Hi"
    assert v.tokenize("", add_special=False) == []


def test_special_tokens_and_parse_special(model):
    v = model.vocab
    assert v.is_eog(v.eos) and not v.is_eog(v.tokenize("a", add_special=False)[0])
    text = v.piece(v.eos, special=True).decode()
    assert text and v.piece(v.eos) == b""  # control tokens render only with special=True
    assert v.tokenize(text, add_special=False, parse_special=True) == [v.eos]
    assert v.eos not in v.tokenize(text, add_special=False, parse_special=False)
    assert v.is_control(v.eos)


def test_token_decoder_multibyte_utf8(engine, model):
    v = model.vocab
    text = "a𝔘𝔫𝔦 ⟪é⟫ 🦜🦩 done"
    toks = v.tokenize(text, add_special=False)
    pieces = [v.piece(t) for t in toks]
    partial = [p for p in pieces if _incomplete_utf8(p)]
    assert partial, "test text should contain characters split across tokens"
    dec = engine.TokenDecoder(v)
    out = [dec.feed(t) for t in toks]
    assert all("\ufffd" not in s for s in out)
    joined = "".join(out) + dec.flush()
    assert joined == b"".join(pieces).decode("utf-8")
    assert joined.lstrip(" ") == text  # SPM pieces carry the space prefix that detokenize() drops
    # an incomplete tail is not emitted by feed(); flush() turns it into U+FFFD
    dec2 = engine.TokenDecoder(v)
    first_partial = next(i for i, p in enumerate(pieces) if _incomplete_utf8(p))
    emitted = "".join(dec2.feed(t) for t in toks[: first_partial + 1])
    assert "\ufffd" not in emitted
    assert dec2.flush().endswith("\ufffd")


def test_bpe_vocab_round_trip_and_decoder(engine, bpe_vocab_path):
    with engine.Model(bpe_vocab_path, vocab_only=True) as m:
        v = m.vocab
        assert v.type == "bpe"
        text = "Byte-level BPE: naïve 日本語 𝔘𝔫𝔦 🦜\n\tend"
        toks = v.tokenize(text, add_special=False)
        assert v.detokenize(toks) == text
        dec = engine.TokenDecoder(v)
        out = [dec.feed(t) for t in toks]
        assert "\ufffd" not in "".join(out) and "".join(out) + dec.flush() == text
        assert any(_incomplete_utf8(v.piece(t)) for t in toks)


def _incomplete_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def test_tokenize_from_threads(model):
    v = model.vocab
    expected = v.tokenize("thread safety " * 50)
    results = []

    def work():
        results.append(all(v.tokenize("thread safety " * 50) == expected for _ in range(20)))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 4


# -- model metadata ----------------------------------------------------------------------------------

def test_model_metadata(model):
    assert model.arch == "llama"
    assert model.meta("general.architecture") == "llama"
    assert model.meta("no.such.key") is None
    md = model.meta_dict()
    assert md["general.architecture"] == "llama"
    assert model.n_layer >= 1 and model.n_embd > 0 and model.n_head >= model.n_head_kv > 0
    assert model.n_ctx_train > 0 and model.n_params > 0 and model.size > 0
    assert model.n_layer_nextn == 0
    assert not model.is_recurrent and not model.is_hybrid and not model.has_encoder
    assert "llama" in model.desc
    tmpl = model.chat_template()
    assert tmpl is None or isinstance(tmpl, str)


# -- decoding ----------------------------------------------------------------------------------------

def test_greedy_decode_is_deterministic(engine, model):
    prompt = model.vocab.tokenize(PROMPTS[0])
    with make_ctx(engine, model) as ctx:
        toks1, logits1 = greedy_run(engine, ctx, prompt, 8)
        ctx.memory_clear()
        toks2, logits2 = greedy_run(engine, ctx, prompt, 8)
    with make_ctx(engine, model) as ctx:
        toks3, _ = greedy_run(engine, ctx, prompt, 8)
    assert toks1 == toks2 == toks3
    assert all(np.array_equal(a, b) for a, b in zip(logits1, logits2))
    with make_ctx(engine, model) as ctx:  # the sampler path picks the same tokens as argmax
        b = engine.Batch(64)
        b.add_many(prompt, 0, 0)
        ctx.decode(b)
        chain = engine.Sampler.chain([engine.Sampler.greedy()])
        got = []
        for i in range(8):
            tok = chain.sample(ctx, b.n_tokens - 1)
            got.append(tok)
            b.clear()
            b.add(tok, len(prompt) + i, 0, True)
            ctx.decode(b)
        chain.close()
    assert got == toks1


def test_four_sequences_in_one_batch_match_one_at_a_time(engine, model):
    v, n_gen = model.vocab, 6
    prompts = [v.tokenize(p) for p in PROMPTS]
    singles = []
    with make_ctx(engine, model) as ctx:
        for p in prompts:
            ctx.memory_clear()
            singles.append(greedy_run(engine, ctx, p, n_gen)[0])
    with make_ctx(engine, model, n_ctx=1024, n_seq_max=4) as ctx:
        b = engine.Batch(sum(map(len, prompts)), n_seq_max=1)
        last = [b.add_many(p, 0, s) for s, p in enumerate(prompts)]
        ctx.decode(b)
        toks = [[] for _ in prompts]
        pos = [len(p) for p in prompts]
        for _ in range(n_gen):
            nxt = [int(ctx.logits_ith(i).argmax()) for i in last]
            b.clear()
            for s, t in enumerate(nxt):
                toks[s].append(t)
                last[s] = b.add(t, pos[s], s, True)
                pos[s] += 1
            ctx.decode(b)
    assert toks == singles


def test_state_save_restore_gives_bitwise_same_logits(engine, model):
    prompt = model.vocab.tokenize(PROMPTS[1])
    nxt = model.vocab.tokenize(" Paris", add_special=False)[0]
    with make_ctx(engine, model, n_seq_max=2) as ctx:
        b = engine.Batch(64)
        b.add_many(prompt, 0, 0)
        ctx.decode(b)
        size = ctx.state_seq_size(0)
        state = ctx.state_seq_get(0)
        assert state.dtype == np.uint8 and 0 < len(state) <= size
        pool = bytearray(size + 64)  # a caller-owned checkpoint buffer
        assert ctx.state_seq_get_into(pool, 0) == len(state)
        assert bytes(pool[: len(state)]) == state.tobytes()

        def next_logits(seq):
            b.clear()
            b.add(nxt, len(prompt), seq, True)
            ctx.decode(b)
            return ctx.logits_ith(0).copy()

        reference = next_logits(0)
        b.clear()
        b.add(nxt, len(prompt) + 1, 0, True)  # change the sequence further, then wipe everything
        ctx.decode(b)
        ctx.memory_clear()
        assert ctx.seq_pos_max(0) == -1
        assert ctx.state_seq_set(state, 0) == len(state)
        assert ctx.seq_pos_max(0) == len(prompt) - 1
        assert np.array_equal(next_logits(0), reference)
        # restoring into another sequence id from the pooled buffer works too
        assert ctx.state_seq_set(memoryview(pool)[: len(state)], 1) == len(state)
        assert np.array_equal(next_logits(1), reference)


def test_state_errors(engine, model):
    prompt = model.vocab.tokenize(PROMPTS[1])
    with make_ctx(engine, model) as ctx:
        b = engine.Batch(64)
        b.add_many(prompt, 0, 0)
        ctx.decode(b)
        with pytest.raises(engine.StateError, match="failed"):
            ctx.state_seq_get_into(bytearray(16), 0)
        with pytest.raises(engine.StateError):
            ctx.state_seq_set(b"\x00" * 64, 0)
        with pytest.raises(engine.StateError, match="magic"):
            ctx.state_seq_set(b"\x00" * 64, 0, flags=engine.STATE_SEQ_FLAGS_ON_DEVICE)


def test_seq_rm_rollback_then_redecode_gives_same_logits(engine, model):
    v = model.vocab
    prompt = v.tokenize(PROMPTS[2])
    draft = v.tokenize(" 6 7 8 9", add_special=False)
    with make_ctx(engine, model) as ctx:
        b = engine.Batch(64)
        b.add_many(prompt, 0, 0)
        ctx.decode(b)
        b.clear()
        b.add(draft[0], len(prompt), 0, True)
        ctx.decode(b)
        reference = ctx.logits_ith(0).copy()
        b.clear()
        b.add_many(draft[1:], len(prompt) + 1, 0)  # speculative tokens we then reject
        ctx.decode(b)
        assert ctx.seq_pos_max(0) == len(prompt) + len(draft) - 1
        assert ctx.seq_rm(0, len(prompt), -1)
        assert ctx.seq_pos_max(0) == len(prompt) - 1 and ctx.seq_pos_min(0) == 0
        b.clear()
        b.add(draft[0], len(prompt), 0, True)
        ctx.decode(b)
        assert np.array_equal(ctx.logits_ith(0), reference)


def test_seq_cp_keep_add(engine, model):
    prompt = model.vocab.tokenize(PROMPTS[3])
    with make_ctx(engine, model, n_seq_max=3, kv_unified=True) as ctx:
        b = engine.Batch(64)
        b.add_many(prompt, 0, 0)
        ctx.decode(b)
        ctx.seq_cp(0, 1)
        assert ctx.seq_pos_max(1) == len(prompt) - 1
        ctx.seq_keep(1)
        assert ctx.seq_pos_max(0) == -1 and ctx.seq_pos_max(1) == len(prompt) - 1
        if ctx.can_shift():
            ctx.seq_add(1, 0, -1, 3)
            assert ctx.seq_pos_max(1) == len(prompt) + 2


def test_multi_sequence_token_and_batch_api(engine):
    b = engine.Batch(4, n_seq_max=2)
    assert b.add(7, 0, [0, 1], False) == 0
    assert b.n_seq_id[0] == 2 and list(b.seq_id[0]) == [0, 1]
    assert b.add_many([1, 2, 3], 1, 0) == 3
    assert list(b.pos[:4]) == [0, 1, 2, 3] and list(b.logits[:4]) == [0, 0, 0, 1]
    assert b.n_outputs == 1
    b.set_logits(0, True)
    assert b.n_outputs == 2
    with pytest.raises(engine.EngineError, match="full"):
        b.add(1, 4, 0, True)
    with pytest.raises(engine.EngineError, match="sequence ids"):
        b.clear() or b.add(1, 0, [0, 1, 2], True)
    b.close()
    b.close()
    with pytest.raises(engine.EngineError, match="closed"):
        b.add(1, 0, 0, True)


# -- outputs -----------------------------------------------------------------------------------------

def test_logits_are_views_without_copy(engine, model):
    prompt = model.vocab.tokenize(PROMPTS[0])
    with make_ctx(engine, model) as ctx:
        b = engine.Batch(64)
        for i, t in enumerate(prompt):
            b.add(t, i, 0, i >= len(prompt) - 2)  # two outputs
        ctx.decode(b)
        row = ctx.logits_ith(-1)
        all_rows = ctx.logits()
        assert row.dtype == np.float32 and row.shape == (model.vocab.n_tokens,)
        assert all_rows.shape == (2, model.vocab.n_tokens) and ctx.n_outputs == 2
        assert np.shares_memory(row, all_rows) and not row.flags.owndata
        assert np.array_equal(all_rows[1], row)
        before = all_rows[0].copy()
        b.clear()
        b.add(int(row.argmax()), len(prompt), 0, True)
        ctx.decode(b)
        # the same memory now holds the next step's logits: the old view sees them
        assert np.shares_memory(ctx.logits_ith(0), all_rows[0])
        assert not np.array_equal(all_rows[0], before)
        with pytest.raises(engine.EngineError, match="no logits"):
            ctx.logits_ith(5)


def test_decode_releases_the_gil(engine, model):
    prompt = (model.vocab.tokenize(" the quick brown fox", add_special=False) * 200)[:1024]
    with make_ctx(engine, model, n_ctx=2048, n_batch=1024, n_ubatch=1024, n_threads=1) as ctx:
        b = engine.Batch(len(prompt))
        b.add_many(prompt, 0, 0)
        stamps: list[float] = []
        stop = threading.Event()

        def spin():
            while not stop.is_set():
                stamps.append(time.perf_counter())

        t = threading.Thread(target=spin)
        t.start()
        time.sleep(0.01)
        t0 = time.perf_counter()
        ctx.decode(b)
        t1 = time.perf_counter()
        stop.set()
        t.join()
    during = sum(1 for s in stamps if t0 < s < t1)
    assert t1 - t0 > 0.02, "decode too short to measure"
    # with the GIL held through the call the spinning thread could not run at all meanwhile
    assert during > 1000, f"only {during} iterations in {t1 - t0:.3f}s of decode"


def test_decode_errors(engine, model):
    with make_ctx(engine, model, n_ctx=256, n_batch=256, n_ubatch=256) as ctx:
        b = engine.Batch(256)
        b.add(model.vocab.n_tokens + 5, 0, 0, True)
        with pytest.raises(engine.DecodeError) as ei:
            ctx.decode(b)
        assert ei.value.code == -1 and "invalid" in str(ei.value)
        b.clear()
        b.add_many([model.vocab.bos] * 256, 0, 0)
        ctx.decode(b)
        b.clear()
        b.add(model.vocab.bos, 256, 0, True)
        with pytest.raises(engine.DecodeError) as ei:
            ctx.decode(b)
        assert ei.value.code == 1 and "no KV cache slot" in str(ei.value)
        b.clear()
        with pytest.raises(engine.EngineError, match="empty"):
            ctx.decode(b)
        assert ctx.seq_pos_max(0) == 255  # the context still works after the errors


def test_perf_counters(engine, model):
    prompt = model.vocab.tokenize(PROMPTS[0])
    with make_ctx(engine, model) as ctx:
        greedy_run(engine, ctx, prompt, 3)
        p = ctx.perf()
        assert p["n_p_eval"] == len(prompt) and p["n_eval"] >= 2 and p["t_p_eval_ms"] > 0
        ctx.perf_reset()
        assert ctx.perf()["t_eval_ms"] == 0  # upstream reports counts clamped to >= 1
        assert ctx.n_ctx == 512 and ctx.n_batch == 128 and ctx.n_ubatch == 128 and ctx.n_seq_max == 1
        assert ctx.model is model


# -- samplers ----------------------------------------------------------------------------------------

def _decoded(engine, model, ctx, text):
    b = engine.Batch(64)
    b.add_many(model.vocab.tokenize(text), 0, 0)
    ctx.decode(b)
    return b.n_tokens - 1


def test_sampler_stages(engine, model):
    S, n_vocab = engine.Sampler, model.vocab.n_tokens
    with make_ctx(engine, model) as ctx:
        idx = _decoded(engine, model, ctx, PROMPTS[0])
        argmax = int(ctx.logits_ith(idx).argmax())
        full = S.chain([S.penalties(64, 1.1, 0.1, 0.1), S.top_k(40), S.typical(0.95), S.top_p(0.9),
                        S.min_p(0.05), S.temp_ext(0.8, 0.1, 1.0), S.temp(0.7), S.dist(1234)])
        twin = full.clone()
        a, b = full.sample(ctx, idx), twin.sample(ctx, idx)
        assert a == b and 0 <= a < n_vocab  # same seed, same state
        forced = (argmax + 1) % n_vocab
        biased = S.chain([S.logit_bias(n_vocab, {forced: 1000.0}), S.greedy()])
        assert biased.sample(ctx, idx) == forced
        greedy0 = S.chain([S.temp(0.0), S.dist(1)])
        assert greedy0.sample(ctx, idx) == argmax
        assert "top_k" in full.kind and full.n_stages == 8 and full.name
        for s in (full, twin, biased, greedy0):
            s.accept(argmax)
            s.reset()
            s.close()
            s.close()
        stage = S.top_k(5)
        chain = S.chain([stage, S.greedy()])
        with pytest.raises(engine.EngineError, match="moved into a chain"):
            stage.accept(1)
        stage.close()  # a consumed stage: no double free
        chain.close()
        with pytest.raises(engine.EngineError, match="cannot pick a token"):
            S.chain([S.top_k(5)]).sample(ctx, idx)
        with pytest.raises(engine.EngineError, match="no output"):
            S.chain([S.greedy()]).sample(ctx, 3)


def test_grammar_sampler(engine, model):
    S, v = engine.Sampler, model.vocab
    with make_ctx(engine, model) as ctx:
        idx = _decoded(engine, model, ctx, "Answer:")
        pos = ctx.seq_pos_max(0) + 1
        chain = S.chain([S.grammar(v, 'root ::= " yes" | " no"'), S.greedy()])
        out, b = [], engine.Batch(8)
        for _ in range(4):
            tok = chain.sample(ctx, idx)
            if v.is_eog(tok):
                break
            out.append(tok)
            b.clear()
            idx = b.add(tok, pos, 0, True)
            pos += 1
            ctx.decode(b)
        assert b"".join(v.piece(t) for t in out).decode().strip() in ("yes", "no")
        chain.close()
    with pytest.raises(engine.GrammarError, match="invalid GBNF"):
        S.grammar(v, "root ::= (")
    lazy = S.grammar_lazy(v, 'root ::= "x"', trigger_patterns=["<tool>"])
    lazy.close()


def test_backend_sampling_matches_host_greedy(engine, model):
    prompt = model.vocab.tokenize(PROMPTS[3])
    with make_ctx(engine, model) as host:
        expected = greedy_run(engine, host, prompt, 3)[0]
    chain = engine.Sampler.chain([engine.Sampler.greedy()])
    with make_ctx(engine, model, backend_samplers={0: chain}) as ctx:
        b = engine.Batch(64)
        b.add_many(prompt, 0, 0)
        got = []
        for i in range(3):
            ctx.decode(b)
            tok = ctx.sampled_token_ith(b.n_tokens - 1)
            assert tok == chain.sample(ctx, b.n_tokens - 1)  # host sampling returns the backend's token
            got.append(tok)
            b.clear()
            b.add(tok, len(prompt) + i, 0, True)
        with pytest.raises(engine.EngineError, match="attached"):
            chain.close()
        assert ctx.set_backend_sampler(0, None)
        chain.close()
    assert got == expected


def test_backend_sampler_attach_later(engine, model):
    prompt = model.vocab.tokenize(PROMPTS[0])
    with make_ctx(engine, model) as host:
        expected = greedy_run(engine, host, prompt, 1)[0][0]
    chain = engine.Sampler.chain([engine.Sampler.greedy()])
    with make_ctx(engine, model) as ctx:
        assert ctx.set_backend_sampler(0, chain)
        idx = _decoded(engine, model, ctx, PROMPTS[0])
        assert ctx.sampled_token_ith(idx) == expected
        with pytest.raises(engine.EngineError, match="chain"):
            ctx.set_backend_sampler(0, engine.Sampler.greedy())
        host_only = engine.Sampler.chain([engine.Sampler.penalties(64, 1.1), engine.Sampler.greedy()])
        assert not ctx.set_backend_sampler(1, host_only)  # refused: sample it on the host instead
        host_only.close()
    chain.close()  # closing the context detached it


# -- extended batch ----------------------------------------------------------------------------------

def test_batch_ext_process_matches_decode(engine, model):
    if not engine.has_feature("llama_process"):
        pytest.skip("engine build without llama_process")
    prompt = model.vocab.tokenize(PROMPTS[1])
    with make_ctx(engine, model) as ctx:
        b = engine.Batch(64)
        b.add_many(prompt, 0, 0)
        ctx.decode(b)
        reference = ctx.logits_ith(-1).copy()
    with make_ctx(engine, model) as ctx:
        bx = engine.BatchExt(ctx)
        last = bx.add_many(prompt, 0, 0)
        assert last == len(prompt) - 1 and bx.n_outputs == 1
        ctx.process(bx, "decode")
        assert np.allclose(ctx.logits_ith(last), reference, atol=1e-5)
        bx.clear()
        bx.add(int(reference.argmax()), len(prompt), 0, True)
        ctx.process(bx, "decode")
        assert ctx.seq_pos_max(0) == len(prompt)
    assert bx._ptr is None  # closed with its context


# -- lifetime, devices, logs -------------------------------------------------------------------------

def test_close_order_and_use_after_close(engine, tiny_path):
    m = engine.Model(tiny_path)
    ctx = make_ctx(engine, m)
    grammar = engine.Sampler.grammar(m.vocab, 'root ::= "a"')
    m.close()
    assert ctx.closed and grammar.closed
    one = engine.Batch(1)
    one.add(1, 0, 0, True)
    with pytest.raises(engine.EngineError, match="closed"):
        ctx.decode(one)
    with pytest.raises(engine.EngineError, match="closed"):
        m.vocab.tokenize("x")
    with pytest.raises(engine.EngineError, match="closed"):
        make_ctx(engine, m)
    m.close()
    ctx.close()


def test_list_devices(engine):
    devs = engine.list_devices()
    assert any(d["type"] == "cpu" for d in devs)
    for d in devs:
        assert set(d) >= {"name", "description", "type", "memory_free", "memory_total"}
        assert d["type"] in ("cpu", "gpu", "igpu", "accel", "meta")


def test_llama_log_is_routed(engine, tiny_path, caplog):
    with caplog.at_level(logging.INFO, logger="app.engine.llama"):
        engine.Model(tiny_path).close()
    lines = [r.getMessage() for r in caplog.records if r.name == "app.engine.llama"]
    assert any("llama_model_loader" in ln or "print_info" in ln for ln in lines)
    assert all("\n" not in ln for ln in lines)
