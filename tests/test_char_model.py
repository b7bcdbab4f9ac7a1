"""Finite-difference checks of examples/char_model.py (float64, tiny sizes)."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import char_model  # noqa: E402

V, E, H, T, B = 7, 5, 4, 6, 3


def _setup(mode, seed=0):
    rng = np.random.default_rng(seed)
    params = char_model.init_params(rng, vocab=V, emb_dim=E, hidden=H, seq_len=T, mode=mode,
                                    dtype=np.float64)
    # non-zero biases and larger weights so every path (gates, biases) is exercised
    for k in params:
        params[k] = params[k] + 0.5 * rng.standard_normal(params[k].shape)
    emb = rng.standard_normal((B, T, E))
    labels = rng.integers(0, V, size=(B, T) if mode == "next" else (B,))
    return params, emb, labels


def _numeric_grad(f, x, eps=1e-6):
    g = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        old = x[i]
        x[i] = old + eps
        fp = f()
        x[i] = old - eps
        fm = f()
        x[i] = old
        g[i] = (fp - fm) / (2 * eps)
    return g


def _assert_close(analytic, numeric, name):
    err = np.max(np.abs(analytic - numeric)) / max(1e-8, np.max(np.abs(numeric)))
    assert err < 1e-6, f"{name}: relative error {err:.3g}"
    assert np.max(np.abs(numeric)) > 1e-6, f"{name}: gradient is all zero, test is vacuous"


@pytest.mark.parametrize("mode", char_model.MODES)
def test_param_gradients(mode):
    params, emb, labels = _setup(mode)
    loss, grads, _ = char_model.loss_and_grads(params, emb, labels)
    assert set(grads) == set(params)
    for name, p in params.items():
        assert grads[name].shape == p.shape and grads[name].dtype == p.dtype
        num = _numeric_grad(lambda: char_model.loss_and_grads(params, emb, labels)[0], p)
        _assert_close(grads[name], num, name)


@pytest.mark.parametrize("mode", char_model.MODES)
def test_emb_gradient(mode):
    params, emb, labels = _setup(mode, seed=1)
    _, _, d_emb = char_model.loss_and_grads(params, emb, labels)
    assert d_emb.shape == emb.shape
    num = _numeric_grad(lambda: char_model.loss_and_grads(params, emb, labels)[0], emb)
    _assert_close(d_emb, num, "d_emb")


def test_check_detects_a_wrong_gradient(monkeypatch):
    """The comparison above is able to fail: break the backward pass slightly and the
    check must notice."""
    params, emb, labels = _setup("next", seed=2)
    real = char_model._gru_backward

    def broken(params, cache, d_out):
        grads, d_emb = real(params, cache, d_out)
        grads["gru_recurrent_kernel"] = grads["gru_recurrent_kernel"] * 1.01
        return grads, d_emb

    monkeypatch.setattr(char_model, "_gru_backward", broken)
    _, grads, _ = char_model.loss_and_grads(params, emb, labels)
    p = params["gru_recurrent_kernel"]
    num = _numeric_grad(lambda: char_model.loss_and_grads(params, emb, labels)[0], p)
    with pytest.raises(AssertionError):
        _assert_close(grads["gru_recurrent_kernel"], num, "gru_recurrent_kernel")


def test_loss_matches_reference_forward():
    """Loss equals an independent, per-step, per-gate naive implementation."""
    params, emb, labels = _setup("next", seed=3)
    loss, _, _ = char_model.loss_and_grads(params, emb, labels)
    Wx, Wh, b, bhn = (params[k] for k in ("gru_kernel", "gru_recurrent_kernel", "gru_bias",
                                          "gru_recurrent_bias_n"))
    sig = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
    total = 0.0
    for bi in range(B):
        h = np.zeros(H)
        for t in range(T):
            x = emb[bi, t]
            z = sig(x @ Wx[:, :H] + b[:H] + h @ Wh[:, :H])
            r = sig(x @ Wx[:, H:2 * H] + b[H:2 * H] + h @ Wh[:, H:2 * H])
            n = np.tanh(x @ Wx[:, 2 * H:] + b[2 * H:] + r * (h @ Wh[:, 2 * H:] + bhn))
            h = (1 - z) * n + z * h
            logits = h @ params["dense_kernel"] + params["dense_bias"]
            logp = logits - np.log(np.sum(np.exp(logits)))
            total -= logp[labels[bi, t]]
    assert loss == pytest.approx(total / (B * T), rel=1e-10)


def test_float32_and_logits_consistent():
    rng = np.random.default_rng(4)
    params = char_model.init_params(rng, vocab=V, emb_dim=E, hidden=H, seq_len=T, mode="guide")
    assert all(v.dtype == np.float32 for v in params.values())
    emb = rng.standard_normal((B, T, E)).astype(np.float32)
    labels = rng.integers(0, V, size=B)
    loss, grads, d_emb = char_model.loss_and_grads(params, emb, labels)
    assert d_emb.dtype == np.float32 and all(g.dtype == np.float32 for g in grads.values())
    logits = char_model.forward_logits(params, emb, mode="guide").astype(np.float64)
    logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    assert loss == pytest.approx(-logp[np.arange(B), labels].mean(), rel=1e-4)


@pytest.mark.parametrize("mode", char_model.MODES)
def test_generate(mode):
    rng = np.random.default_rng(5)
    params = char_model.init_params(rng, vocab=V, emb_dim=E, hidden=H, seq_len=T, mode=mode)
    table = rng.standard_normal((V, E)).astype(np.float32)
    out = char_model.generate(params, table, [1, 2, 3], 20, np.random.default_rng(0),
                              temperature=1.0, num_valid=4)
    assert len(out) == 20 and all(0 <= i < 4 for i in out)
    again = char_model.generate(params, table, [1, 2, 3], 20, np.random.default_rng(0),
                                temperature=1.0, num_valid=4)
    assert out == again


def test_generate_greedy_matches_forward():
    """Greedy generation's first character is the argmax of the full forward pass."""
    rng = np.random.default_rng(6)
    params = char_model.init_params(rng, vocab=V, emb_dim=E, hidden=H, seq_len=T, mode="next")
    table = rng.standard_normal((V, E)).astype(np.float32)
    prefix = [3, 1, 4, 1, 5]
    first = char_model.generate(params, table, prefix, 1, rng, temperature=0)[0]
    logits = char_model.forward_logits(params, table[prefix][None], mode="next")
    assert first == int(np.argmax(logits[0, -1]))
