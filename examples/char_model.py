"""The Shakespeare character model of the TF-IPU host-embedding guide's example, in pure
numpy (no MPI in this file).

Model (the example's ``model()``, with the embedding lookup kept outside so it can be
sharded across replicas by ``popdist_lite``)::

    emb (B, T, E) -> GRU(H) -> outputs (B, T, H) -> dense -> softmax -> cross-entropy

Two label modes:

``"next"`` (default)
    Predict every next character: the dense layer maps each GRU output (H -> V) and the
    loss is the mean cross-entropy over all B*T positions.  ``labels`` is (B, T).

``"guide"``
    The configuration of the guide's example: the GRU outputs of all T steps are flattened into one
    vector per sequence (``tf.reshape(partial, [batch, -1])``), a dense layer maps T*H ->
    V and the label is the character following the sequence.  ``labels`` is (B,).

The GRU is the "reset after" variant (cuDNN / Keras ``reset_after=True``)::

    z = sigmoid(x Wz + bz + h Uz)            update gate
    r = sigmoid(x Wr + br + h Ur)            reset gate
    n = tanh(x Wn + bn + r * (h Un + bhn))   candidate
    h' = (1 - z) * n + z * h

so that all recurrent gate contributions come from a single ``(B, H) @ (H, 3H)`` matmul per
step, and all input contributions from a single ``(B*T, E) @ (E, 3H)`` matmul up front.
Gate order in the packed kernels is ``[z | r | n]``.  Everything is float32; the
functions are dtype-generic so the tests can run them in float64.
"""

from __future__ import annotations

import numpy as np

MODES = ("next", "guide")

__all__ = ["MODES", "init_params", "loss_and_grads", "forward_logits", "generate"]


# --------------------------------------------------------------------------------------
# parameters
# --------------------------------------------------------------------------------------
def _glorot_uniform(rng: np.random.Generator, fan_in: int, fan_out: int) -> np.ndarray:
    limit = np.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-limit, limit, size=(fan_in, fan_out))


def _orthogonal(rng: np.random.Generator, n: int) -> np.ndarray:
    q, r = np.linalg.qr(rng.standard_normal((n, n)))
    return q * np.sign(np.diag(r))


def init_params(
    rng: np.random.Generator,
    vocab: int = 256,
    emb_dim: int = 256,
    hidden: int = 256,
    seq_len: int = 100,
    mode: str = "next",
    dtype=np.float32,
) -> dict[str, np.ndarray]:
    """Initial dense parameters (Keras defaults: Glorot kernels, orthogonal recurrent
    kernel, zero biases).  ``seq_len`` only matters in ``"guide"`` mode, where the dense
    kernel is (seq_len * hidden, vocab)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    H = hidden
    dense_in = H if mode == "next" else seq_len * H
    params = {
        "gru_kernel": _glorot_uniform(rng, emb_dim, 3 * H),
        "gru_recurrent_kernel": np.concatenate([_orthogonal(rng, H) for _ in range(3)], axis=1),
        "gru_bias": np.zeros(3 * H),
        "gru_recurrent_bias_n": np.zeros(H),
        "dense_kernel": _glorot_uniform(rng, dense_in, vocab),
        "dense_bias": np.zeros(vocab),
    }
    return {k: np.ascontiguousarray(v, dtype=dtype) for k, v in params.items()}


def _mode_of(params: dict[str, np.ndarray], labels: np.ndarray) -> str:
    H = params["gru_recurrent_kernel"].shape[0]
    mode = "next" if labels.ndim == 2 else "guide"
    if labels.ndim not in (1, 2):
        raise ValueError(f"labels must be (B, T) or (B,), got shape {labels.shape}")
    if mode == "next" and params["dense_kernel"].shape[0] != H:
        raise ValueError("labels are (B, T) (next-char mode) but the dense kernel was "
                         "initialised for guide mode (T*H inputs)")
    return mode


# --------------------------------------------------------------------------------------
# GRU forward / backward
# --------------------------------------------------------------------------------------
def _sigmoid(x: np.ndarray) -> np.ndarray:
    # exp of a float32 overflows above ~88; clip so saturated gates stay quiet.
    return 1.0 / (1.0 + np.exp(-np.clip(x, -60.0, 60.0)))


def _gru_forward(params, emb):
    """emb (B, T, E) -> outputs (T, B, H) time-major, plus a cache for the backward."""
    B, T, E = emb.shape
    Wx = params["gru_kernel"]
    Wh = params["gru_recurrent_kernel"]
    b = params["gru_bias"]
    bhn = params["gru_recurrent_bias_n"]
    H = Wh.shape[0]
    dt = Wx.dtype

    # All input contributions at once, laid out time-major so each step reads a
    # contiguous (B, 3H) block.
    emb_tm = np.ascontiguousarray(emb.transpose(1, 0, 2), dtype=dt)  # (T, B, E)
    xp = (emb_tm.reshape(T * B, E) @ Wx).reshape(T, B, 3 * H)
    xp += b

    hs = np.empty((T + 1, B, H), dtype=dt)  # hs[0] = h0 = 0, hs[t+1] = output at t
    hs[0] = 0.0
    z_all = np.empty((T, B, H), dtype=dt)
    r_all = np.empty((T, B, H), dtype=dt)
    n_all = np.empty((T, B, H), dtype=dt)
    hn_all = np.empty((T, B, H), dtype=dt)  # h Un + bhn
    for t in range(T):
        h = hs[t]
        hp = h @ Wh  # (B, 3H)
        x = xp[t]
        zr = _sigmoid(x[:, : 2 * H] + hp[:, : 2 * H])
        z = zr[:, :H]
        r = zr[:, H:]
        hn = hp[:, 2 * H:]
        hn += bhn
        n = np.tanh(x[:, 2 * H:] + r * hn)
        # h' = (1 - z) * n + z * h = n + z * (h - n)
        np.add(n, z * (h - n), out=hs[t + 1])
        z_all[t] = z
        r_all[t] = r
        n_all[t] = n
        hn_all[t] = hn
    cache = (emb_tm, hs, z_all, r_all, n_all, hn_all)
    return hs[1:], cache


def _gru_backward(params, cache, d_out):
    """d_out (T, B, H): gradient of the loss w.r.t. the GRU outputs.
    Returns (grads for the GRU parameters, d_emb (B, T, E))."""
    emb_tm, hs, z_all, r_all, n_all, hn_all = cache
    Wx = params["gru_kernel"]
    Wh = params["gru_recurrent_kernel"]
    T, B, E = emb_tm.shape
    H = Wh.shape[0]
    dt = Wx.dtype

    WhT = np.ascontiguousarray(Wh.T)
    dxp = np.empty((T, B, 3 * H), dtype=dt)  # grads of the pre-activations (input side)
    dhp = np.empty((T, B, 3 * H), dtype=dt)  # grads of h @ Wh (+ bhn for the n part)
    dh_next = np.zeros((B, H), dtype=dt)
    for t in range(T - 1, -1, -1):
        dh = d_out[t] + dh_next
        z = z_all[t]
        r = r_all[t]
        n = n_all[t]
        h_prev = hs[t]
        # h' = n + z * (h_prev - n)
        dan = dh * (1.0 - z) * (1.0 - n * n)          # through tanh
        daz = dh * (h_prev - n) * z * (1.0 - z)       # through sigmoid
        dar = dan * hn_all[t] * r * (1.0 - r)
        dxp[t, :, :H] = daz
        dxp[t, :, H:2 * H] = dar
        dxp[t, :, 2 * H:] = dan
        dhp[t, :, :2 * H] = dxp[t, :, :2 * H]
        dhp[t, :, 2 * H:] = dan * r
        dh_next = dh * z + dhp[t] @ WhT

    dxp_flat = dxp.reshape(T * B, 3 * H)
    dhp_flat = dhp.reshape(T * B, 3 * H)
    grads = {
        "gru_kernel": emb_tm.reshape(T * B, E).T @ dxp_flat,
        "gru_recurrent_kernel": hs[:-1].reshape(T * B, H).T @ dhp_flat,
        "gru_bias": dxp_flat.sum(axis=0),
        "gru_recurrent_bias_n": dhp_flat[:, 2 * H:].sum(axis=0),
    }
    d_emb = (dxp_flat @ Wx.T).reshape(T, B, E).transpose(1, 0, 2)
    return grads, np.ascontiguousarray(d_emb)


# --------------------------------------------------------------------------------------
# dense + softmax cross-entropy
# --------------------------------------------------------------------------------------
def _dense_inputs(outs_tm: np.ndarray, mode: str) -> np.ndarray:
    T, B, H = outs_tm.shape
    if mode == "next":
        return outs_tm.reshape(T * B, H)  # rows in (t, b) order
    # guide: (B, T*H), the guide example's reshape of the batch-major GRU outputs
    return np.ascontiguousarray(outs_tm.transpose(1, 0, 2)).reshape(B, T * H)


def forward_logits(params: dict[str, np.ndarray], emb: np.ndarray, mode: str = "next") -> np.ndarray:
    """Logits: (B, T, V) in ``"next"`` mode, (B, V) in ``"guide"`` mode."""
    outs_tm, _ = _gru_forward(params, emb)
    x = _dense_inputs(outs_tm, mode)
    logits = x @ params["dense_kernel"] + params["dense_bias"]
    if mode == "next":
        T, B, _ = outs_tm.shape
        return logits.reshape(T, B, -1).transpose(1, 0, 2)
    return logits


def loss_and_grads(params: dict[str, np.ndarray], emb: np.ndarray, labels: np.ndarray,
                   loss_scale: float = 1.0):
    """Mean cross-entropy and its gradients.

    emb: (B, T, E) embedded input characters.
    labels: (B, T) ints -> next-character mode; (B,) ints -> guide mode.
    loss_scale: the gradients are those of ``loss_scale * loss`` (loss scaling, see
        docs/precision.md); the returned loss is not scaled.
    Returns (loss: float, grads: dict like params, d_emb: (B, T, E)).
    """
    labels = np.asarray(labels)
    mode = _mode_of(params, labels)
    B, T, E = emb.shape
    if labels.shape[0] != B or (mode == "next" and labels.shape != (B, T)):
        raise ValueError(f"labels shape {labels.shape} does not match emb shape {emb.shape}")
    W = params["dense_kernel"]
    if mode == "guide" and W.shape[0] != T * params["gru_recurrent_kernel"].shape[0]:
        raise ValueError(f"guide mode: dense kernel expects {W.shape[0]} inputs, but "
                         f"T*H = {T * params['gru_recurrent_kernel'].shape[0]}")
    V = W.shape[1]
    if labels.min() < 0 or labels.max() >= V:
        raise ValueError(f"labels must be in [0, {V})")

    outs_tm, cache = _gru_forward(params, emb)
    x = _dense_inputs(outs_tm, mode)  # (N, D)
    logits = x @ W
    logits += params["dense_bias"]
    lab = labels.T.reshape(-1) if mode == "next" else labels.reshape(-1)  # (t, b) order
    N = lab.shape[0]

    # stable log-softmax
    logits -= logits.max(axis=1, keepdims=True)
    np.exp(logits, out=logits)
    sums = logits.sum(axis=1, keepdims=True)
    probs = logits
    probs /= sums
    rows = np.arange(N)
    p_true = probs[rows, lab]
    loss = float(-np.mean(np.log(np.maximum(p_true, np.finfo(probs.dtype).tiny))))

    dlogits = probs  # reuse the buffer: softmax - onehot, / N
    dlogits[rows, lab] -= 1.0
    dlogits *= loss_scale / N

    grads = {
        "dense_kernel": x.T @ dlogits,
        "dense_bias": dlogits.sum(axis=0),
    }
    dx = dlogits @ W.T
    H = outs_tm.shape[2]
    if mode == "next":
        d_out = dx.reshape(T, B, H)
    else:
        d_out = np.ascontiguousarray(dx.reshape(B, T, H).transpose(1, 0, 2))
    gru_grads, d_emb = _gru_backward(params, cache, d_out)
    grads.update(gru_grads)
    dt = W.dtype
    grads = {k: np.ascontiguousarray(grads[k], dtype=dt) for k in params}
    return loss, grads, d_emb.astype(dt, copy=False)


# --------------------------------------------------------------------------------------
# sampling
# --------------------------------------------------------------------------------------
def _sample(logits: np.ndarray, rng: np.random.Generator, temperature: float, num_valid) -> int:
    logits = logits.astype(np.float64)
    if num_valid is not None:
        logits = logits[:num_valid]
    if temperature <= 0:
        return int(np.argmax(logits))
    logits = logits / temperature
    p = np.exp(logits - logits.max())
    p /= p.sum()
    return int(rng.choice(p.shape[0], p=p))


def generate(
    params: dict[str, np.ndarray],
    table: np.ndarray,
    prefix_ids,
    n: int,
    rng: np.random.Generator,
    temperature: float = 1.0,
    num_valid: int | None = None,
) -> list[int]:
    """Sample ``n`` characters after ``prefix_ids`` (a non-empty sequence of ids).

    ``table`` is the full (V, E) embedding table.  ``num_valid`` restricts sampling to
    ids ``< num_valid`` (the real vocabulary, when the output layer is wider).
    ``temperature <= 0`` means greedy.  Returns the ``n`` new ids.

    In next-character mode the GRU state is carried forward one character at a time.
    In guide mode the model needs a window of exactly T characters (the dense layer sees
    all T outputs), so each new character reruns the GRU over the last T characters
    (the prefix is left-padded with its first character if shorter than T).
    """
    prefix = [int(i) for i in prefix_ids]
    if not prefix:
        raise ValueError("prefix_ids must not be empty")
    Wx = params["gru_kernel"]
    Wh = params["gru_recurrent_kernel"]
    H = Wh.shape[0]
    Wd = params["dense_kernel"]
    out: list[int] = []
    if Wd.shape[0] == H:  # next-character mode: stateful stepping
        b = params["gru_bias"]
        bhn = params["gru_recurrent_bias_n"]
        h = np.zeros(H, dtype=Wx.dtype)

        def step(h, idx):
            x = table[idx].astype(Wx.dtype) @ Wx + b
            hp = h @ Wh
            zr = _sigmoid(x[: 2 * H] + hp[: 2 * H])
            z, r = zr[:H], zr[H:]
            nn = np.tanh(x[2 * H:] + r * (hp[2 * H:] + bhn))
            return nn + z * (h - nn)

        for idx in prefix:
            h = step(h, idx)
        for _ in range(n):
            nxt = _sample(h @ Wd + params["dense_bias"], rng, temperature, num_valid)
            out.append(nxt)
            h = step(h, nxt)
        return out

    T = Wd.shape[0] // H
    window = prefix[-T:]
    window = [window[0]] * (T - len(window)) + window
    for _ in range(n):
        emb = table[np.asarray(window)][None].astype(Wx.dtype)  # (1, T, E)
        logits = forward_logits(params, emb, mode="guide")[0]
        nxt = _sample(logits, rng, temperature, num_valid)
        out.append(nxt)
        window = window[1:] + [nxt]
    return out
