"""Memory-lean LM loss: the head's matmul and cross-entropy in row chunks equal torch's, without
keeping the logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from measure.saved import saved_bytes
from tempo.ops import linear_ce as C


def _reference(h, w, labels):
    """HF's Llama loss: float32 logits (float64 stays float64), mean over the counted labels."""
    logits = F.linear(h, w)
    logits = logits if h.dtype == torch.float64 else logits.float()
    return F.cross_entropy(logits.reshape(-1, w.shape[0]), labels.reshape(-1), ignore_index=C.IGNORE_INDEX)


def _draw(dtype):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    b, s = int(torch.randint(1, 4, (), generator=g)), int(torch.randint(1, 30, (), generator=g))
    hid, vocab = int(torch.randint(4, 40, (), generator=g)), int(torch.randint(2, 300, (), generator=g))
    h = torch.randn(b, s, hid, generator=g, dtype=torch.float64).to(dtype)
    w = (0.3 * torch.randn(vocab, hid, generator=g, dtype=torch.float64)).to(dtype)
    labels = torch.randint(0, vocab, (b, s), generator=g)
    labels[torch.rand(b, s, generator=g) < 0.2] = C.IGNORE_INDEX
    labels.view(-1)[0] = 0  # at least one row counted
    chunk = int(torch.randint(1, b * s + 3, (), generator=g))
    return h, w, labels, chunk


def _grads(fn, h, w, labels):
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fn(h, w, labels)
    return loss.detach(), torch.autograd.grad(loss, (h, w))


def test_float64_equals_torch():
    h, w, labels, chunk = _draw(torch.float64)
    loss, (dh, dw) = _grads(lambda h, w, y: C.linear_cross_entropy(h, w, y, chunk), h, w, labels)
    ref, (rdh, rdw) = _grads(_reference, h, w, labels)
    assert abs(loss.item() - ref.item()) <= 1e-12 * abs(ref.item())
    for a, r in ((dh, rdh), (dw, rdw)):
        assert ((a - r).norm() / r.norm()).item() <= 1e-10


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_half_and_single_close_to_torch(dtype, tol):
    h, w, labels, chunk = _draw(dtype)
    loss, (dh, dw) = _grads(lambda h, w, y: C.linear_cross_entropy(h, w, y, chunk), h, w, labels)
    ref, (rdh, rdw) = _grads(_reference, h, w, labels)
    assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())  # the loss is float32 in both
    assert dh.dtype == dtype and dw.dtype == dtype
    for a, r in ((dh, rdh), (dw, rdw)):
        assert ((a.double() - r.double()).norm() / r.double().norm()).item() <= tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_dw_is_rounded_once_over_many_chunks(dtype):
    """dW's chunk products are summed in float32 and the sum rounded at the end, not the running
    sum each chunk. Inputs where every chunk's product is exact in 16 bits and their sum exact in
    float32 (vocab 2, a zero head: d logits exactly +-1/(2n); h of 0s and 1s; 253-row chunks; n =
    4096), so dW must equal the float64 dW rounded once, bit for bit. Control: summed in 16 bits
    chunk by chunk (as before), the all-ones column rounds on the way and differs. (Products that
    are not exact round once each too: 1.2-1.35x one GEMM's error, the module docstring.)"""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    n, hid, chunk = 4096, int(torch.randint(2, 33, (), generator=g)), 253
    h = torch.randint(0, 2, (n, hid), generator=g).to(dtype)
    h[:, 0] = 1
    w = torch.zeros(2, hid, dtype=dtype)
    labels = torch.full((n,), int(torch.randint(0, 2, (), generator=g)))
    _, (_, dw) = _grads(lambda h, w, y: C.linear_cross_entropy(h, w, y, chunk), h, w, labels)
    d = torch.full((n, 2), 0.5 / n, dtype=torch.float64)  # softmax 1/2 each, minus 1 at the label
    d[torch.arange(n), labels] -= 1.0 / n
    exact = d.t() @ h.double()
    assert torch.equal(dw, exact.to(dtype))
    in_16_bits = torch.zeros(2, hid, dtype=dtype)
    for start in range(0, n, chunk):
        in_16_bits.addmm_(d[start : start + chunk].t().to(dtype), h[start : start + chunk])
    assert in_16_bits[:, 0].ne(exact[:, 0].to(dtype)).all(), "control: 16-bit sums did not round"


def test_gradcheck():
    h = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 6, C.IGNORE_INDEX, 2, 2])
    assert torch.autograd.gradcheck(lambda h, w: C.linear_cross_entropy(h, w, labels, 2), (h, w))


def test_keeps_no_logits():
    n, hid, vocab = 64, 16, 512
    h = torch.randn(n, hid, requires_grad=True)
    head = torch.nn.Linear(hid, vocab, bias=False)
    labels = torch.randint(0, vocab, (n,))

    class Ours(torch.nn.Module):
        def forward(self, h):
            return C.linear_cross_entropy(h, head.weight, labels, 16)

    class Reference(torch.nn.Module):
        def forward(self, h):
            return F.cross_entropy(head(h).float(), labels)

    ours, ref = saved_bytes(Ours(), h), saved_bytes(Reference(), h)
    # the head's weight (not this module's parameter) and the labels
    assert ours.activation_bytes == vocab * hid * 4 + n * 8
    assert ref.activation_bytes >= n * vocab * 4  # negative control: the logits (and their softmax)


def test_every_row_ignored_is_nan_as_torch():
    """Mean of no row: NaN, as torch's; its gradients zero, as torch's (not 0/0). The sum: 0."""
    h, w = torch.randn(3, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True)
    labels = torch.full((3,), C.IGNORE_INDEX)
    ours, ref = C.linear_cross_entropy(h, w, labels), _reference(h, w, labels)
    assert ours.isnan() and ref.isnan()
    for mine, theirs in zip(torch.autograd.grad(ours, [h, w]), torch.autograd.grad(ref, [h, w]), strict=True):
        assert torch.equal(mine, theirs) and not mine.any()
    total = C.linear_cross_entropy(h, w, labels, reduction="sum")
    assert total.item() == 0.0 and not any(g.any() for g in torch.autograd.grad(total, [h, w]))


def test_sum_reduction_is_the_mean_times_the_counted_rows():
    h, w = (
        torch.randn(40, 8, dtype=torch.float64, requires_grad=True),
        torch.randn(30, 8, dtype=torch.float64),
    )
    labels = torch.randint(0, 30, (40,))
    labels[torch.randperm(40)[:7]] = C.IGNORE_INDEX
    total = C.linear_cross_entropy(h, w, labels, 16, reduction="sum")
    ref = F.cross_entropy(h @ w.T, labels, reduction="sum")
    assert abs(total.item() - ref.item()) <= 1e-12 * abs(ref.item())
    (g,), (g_ref,) = torch.autograd.grad(total, [h]), torch.autograd.grad(ref, [h])
    assert ((g - g_ref).norm() / g_ref.norm()).item() <= 1e-12
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum'"):
        C.linear_cross_entropy(h, w, labels, reduction="none")


def test_bad_input_is_refused_clearly():
    h, w = torch.randn(3, 4), torch.randn(5, 4)
    with pytest.raises(ValueError, match=r"weight must be \[vocab, hidden\]"):
        C.linear_cross_entropy(h, torch.randn(5, 3), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="labels must be integers"):
        C.linear_cross_entropy(h, w, torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"labels must be in \[0, 5\)"):
        C.linear_cross_entropy(h, w, torch.tensor([0, 5, 1]))
    with pytest.raises(ValueError, match="rows_per_chunk"):
        C.linear_cross_entropy(h, w, torch.zeros(3, dtype=torch.long), 0)
