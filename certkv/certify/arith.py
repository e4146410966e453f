"""E_arith: a rigorous bound on what floating point adds to a head's output (pure functions).

The paper's terms E_key and E_val bound the error of attention *in exact arithmetic* on the
quantized cache. The output a caller receives is computed in FP32 (16-bit SDPA on the dense
CUDA path) and cast to the caller's dtype. ``e_arith`` closes the gap, so that for every head

    ``||out - O_ref||_2 <= e_key + e_val + e_arith``,

``O_ref`` being attention in exact arithmetic on the FP16 originals (or, on dense heads,
``||out - O_ref|| <= e_arith``). Everything is computed at run time from per-head magnitudes the
step already has; the composition runs in FP64 (a few dozen ops on ``[Hq]`` tensors) and the
result is rounded up to FP32, so evaluating the bound cannot lose what it bounds.

Model (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., 2.2 and 3.1): every
basic operation is ``fl(a op b) = (a op b)(1 + theta)``, ``|theta| <= u`` (``u = 2^-24`` in
FP32), except in the subnormal range, which is covered by absolute terms (flush-to-zero
included: < ``2^-126`` per operation). ``gamma_n = n u / (1 - n u)``.

1. **Logits** (Phase 1, Phase 2's FP16 keys, the dense path). A dot product whose products
   each pass through at most ``m`` roundings errs by ``<= gamma_m sum_c |q_c k_c|`` (Higham
   3.1; FMA only removes roundings). In *any* order ``m = d`` (the PyTorch paths: a BLAS
   matmul); the Triton kernels sum in two levels (chunks of about ``sqrt(d)`` channels, then
   across chunks: ``m = c + d/c - 1``, 15 at d = 64, 23 at d = 128, :func:`dot_depth`).
   Rounding ``q`` to FP32 (FP64 queries), the scaling to FP32 and the product by it add three
   more roundings. With ``K_c = max_t |k_{t,c}|`` over every cached original (the store's
   running channel maximum) and ``|k_hat_c| <= |k_c| + r_c`` (the codec's channel bound) or
   ``sum_c |q_c| |k_hat_c - k_c| <= ||q|| ||k_hat - k||`` (Cauchy-Schwarz),
   ``scaling * sum_c |q_c| |k'_c| <= S + Delta_b`` with ``S = scaling sum_c |q_c| K_c`` and
   ``Delta_b`` the tightened per-block bound (:func:`~certkv.certify.bounds.tightened_deltas`).
   So every computed logit is within ``eps = gamma_{m+3} (S + Delta) + (underflow)`` of
   ``scaling * q . k'`` for the key ``k'`` the path used. The computed ``Delta_b`` itself
   (an FP32 sum of ``d`` non-negative terms, or the FP32 product ``scaling ||q|| key_err`` with
   ``||q||`` a root of an FP32 sum of squares) is at most ``gamma_{d+8}`` below the exact one,
   which ``eps`` also absorbs; so is the computed ``lambda_b = scaling ||q|| s^K_b``. Hence
   ``|s_hat_t - s_t| <= Delta_b + eps`` on INT8 tail tokens and ``<= eps`` on every other token
   (promoted blocks, the exact tail block), and ``||s_hat_b - s_b||_2 <= lambda_b (1 +
   2 gamma_{d+8}) + sqrt(B) eps`` on an INT8 tail block.

2. **Key term** (eq. 15 with rounded logits). Perturb first the tail ``T`` (by at most
   ``Delta_T + eps``), then the rest ``F`` (by at most ``eps``). TV is a metric, so
   ``TV(p, p_hat) <= min(tanh(D_T/2), a_T (e^{2 D_T} - 1)) + tanh(eps/2)`` with
   ``D_T = Delta_T + eps`` (Lemma A.2 sharpened, Lemma A.3). The true tail mass ``a_T`` is
   bounded as in eq. 14 with every Phase-1 logit off by at most ``Delta + eps`` (Theorem 4.4:
   ``e^{c (Delta + eps)} alpha_hat``), and by ``U_T / (Z_F + U_T)`` with ``U_T, Z_F`` off by
   ``e^{+-eps}``. The log-sum-exps that give ``log alpha_hat``, ``log U_T`` and ``log Z_F`` are
   themselves computed in FP32: each is within ``kappa`` of the exact log-sum-exp of the
   computed logits (item 5). The per-block TV bound
   (:func:`~certkv.certify.bounds.block_tv_bound`) bounds ``TV(p, m)`` for ``m`` the softmax
   of the exact quantized logits (tail tokens moved by ``|x_t| <= Delta_b + eps``,
   ``||x_b|| <= lambda_b (1 + 2 gamma)``), with ``m``'s block masses and spreads at most
   ``e^{2 eps}`` times upper bounds of the computed ones (item 5); ``TV(m, p_hat) <=
   tanh(eps/2)``. Both routes end in ``+ tanh(eps/2)``, so ``TV <= min(eq. 15 form, block
   form) + tanh(eps/2)``. ``E_key+ = 2 R TV`` with ``R = min(V_max, max_t ||v_t - c||)``
   (exact stored values), and ``e_arith`` carries ``E_key+ - E_key``.

3. **Value term.** Phase 2 decodes INT4 values in registers, possibly with an FMA, so its
   reconstruction differs from the codec's own (on which ``eta_b`` was measured exactly) by at
   most the codec's ``decode_rounding`` (``13 u sqrt(g) ||v||``). The block masses ``rho_b``
   are computed with relative error ``omega_rho`` and the block spreads ``||p_b||_2`` with
   ``omega_spread`` (item 5), and ``E_val = sum_b min(rho_b eta_b, s_b ||p_b||_2)`` is an
   FP32 sum of ``n`` minima of products (``min(a (1 + r1), c (1 + r2)) <= (1 + max(r1, r2))
   min(a, c)``): the exact sum is at most ``E_val / ((1 - gamma_{n+1})(1 - max(omega_rho,
   omega_spread)))`` plus the underflow of tiny masses and spreads.

4. **Weighted value sum, normalisation, merge of splits.** With ``Obar = sum_t p_hat_t v'_t``
   (exact softmax of the computed logits times the values the kernel used), every term of the
   numerator and of the denominator is computed with relative error at most
   ``omega_num, omega_den`` (the *rounding chain* of a token: its exponentials and the
   roundings of every product and sum it joins on its way to the output, a property of the
   backend's summation order, see :class:`Rounding`). Writing ``O_hat = N_hat / D_hat``:
   ``||O_hat - Obar|| <= ((u + omega_den) ||Obar|| + (1 + u) omega_num V') / (1 - omega_den)``
   with ``V' >= max_t ||v'_t||`` (``V_max`` plus the largest ``eta`` for decoded values).
   An exponential's argument ``x_t <= 0`` is rounded relatively, which multiplies the weight by
   ``e^{+-3 u |x_t|}``; averaged with the softmax weights this costs ``3 u log N`` (since
   ``E_p[-x] <= H(p) <= log N``, because ``p_t = e^{x_t} / Z`` with ``Z >= 1``). Weights below
   ``e^-88`` may underflow: at most ``2^-120`` each, relative to a denominator ``>= 1``.

5. **Log-sum-exps and block masses.** A log-sum-exp ``m + log sum_i e^{y_i - m}`` over ``k``
   computed inputs errs by at most ``2 (omega_e + gamma_k + u log k) + 4 u log k + u |result|``
   (``omega_e``: one exponential), and input errors pass through with weight at most 1;
   chaining Phase 1's block log-mass, the log-softmax over blocks and the log-sum-exp over the
   tail gives ``kappa`` below (generous constants). Block masses ``rho_b = e^{m_b - top}
   l_b / total`` have relative error at most ``omega_rho``; block spreads ``e^{m_b - top}
   sqrt(sum_t w_t^2) / total`` square each weight (twice its relative error), sum ``B``
   squares and take a root: relative error at most ``omega_spread = (3 omega + gamma_{B+4} +
   B 2^-120) / (1 - omega)`` (a square that flushes to zero loses ``< 2^-126`` of a sum that
   is at least 1: the block's largest weight is ``e^0 = 1``), absolute ``2^-120`` where the
   rescaling underflows.

6. **Cast to the caller's dtype.** FP16 / BF16 rounding moves each component by at most
   ``u_t |x|`` (or half a subnormal spacing), so the output by ``u_t ||O_hat|| + sqrt(d) mu_t``.
   A value beyond the 16-bit range is not bounded but rejected: the head goes dense.

7. **Dense heads** (rungs 3-4 and ``mode=dense``) get items 1, 4 and 6 for the dense path's
   own arithmetic (logit rounding on every token: ``2 V_max tanh(eps/2)``).

The composition is ``(E_key+ + E_val+ + items 4, 6) (1 + 4u) - e_key - e_val`` in FP64, rounded
up to FP32 (so that ``e_key + e_val + e_arith`` summed in FP32 still covers it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import torch

U32 = 2.0**-24  # unit roundoff of FP32
EXP_ULPS = 8  # any exp used (Sleef, libm, CUDA expf / ex2.approx) is within 8 u, argument aside
ARG_ROUNDING = 3  # relative roundings of an exp argument: the subtraction, log2(e) scaling (x2)
NORMAL_EXP = 88.0  # e^-88 > 2^-127: smaller weights are treated as absolute underflow
TINY = 2.0**-120  # absolute allowance per underflowed (or flushed) operation, generous
LOG_ULPS = 8  # a computed FP32 log quantity's own rounding allowance (_widen, kappa)
ROUND_UP_REL, ROUND_UP_ABS = 2.0**-22, 2.0**-140  # FP64 -> FP32 never below (_round_up_fp32)

_UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: U32,
                  torch.float64: 2.0**-53}
_HALF_SUBNORMAL = {torch.float16: 2.0**-25, torch.bfloat16: 2.0**-134}


def gamma(n: float, u: float = U32) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)`` (2.4): relative error of ``n`` roundings."""
    nu = n * u
    return nu / (1.0 - nu) if nu < 0.5 else math.inf


def dot_chunk(d: int) -> int:
    """Channels per chunk of a two-level dot product: the divisor of ``d`` nearest
    ``sqrt(d)`` (8 at d = 64 and 128)."""
    return min((c for c in range(1, d + 1) if d % c == 0), key=lambda c: (abs(c * c - d), -c))


def dot_depth(d: int) -> int:
    """Roundings a product takes in a two-level dot product of ``d`` channels (chunks of
    :func:`dot_chunk`): its own, at most ``c - 1`` additions in its chunk and ``d / c - 1``
    across chunks, whatever order each level uses (a flat dot product: ``d``)."""
    c = dot_chunk(d)
    return c + d // c - 1


def unit_roundoff(dtype: torch.dtype) -> float:
    """Unit roundoff of a float dtype (FP32 for anything unknown)."""
    return _UNIT_ROUNDOFF.get(dtype, U32)


def matmul_input_rounding() -> float:
    """Extra relative rounding of each FP32 matmul input under the current
    ``torch.get_float32_matmul_precision()`` (``high``: TF32, ``medium``: BF16); 0 at
    ``highest``. Einsum-based paths (the PyTorch reference, the dense path) round each product's
    two inputs so; the Triton kernels use plain FP32 multiply-adds and are not affected."""
    return {"highest": 0.0, "high": 2.0**-11}.get(torch.get_float32_matmul_precision(),
                                                  2.0**-8)


@dataclass(frozen=True)
class Rounding:
    """The rounding chain of one token's contribution on a path to the output (item 4).

    Counts are affine in the step's ``n`` blocks and ``N`` tokens, so one description serves
    every step of a backend.

    Args:
        exps, exps_per_token: exponentials a weight passes through (its own, then every
            rescaling by a new running maximum: block to split to head).
        depth, depth_per_block, depth_per_token: further roundings of a numerator term (the
            weight x value product, each sum it joins in the path's actual summation order,
            rescaling products, the division); denominator terms take at most as many.
        dot_depth: roundings a product takes inside a logit's dot product (a two-level sum
            over chunks of channels keeps it near ``2 sqrt(d)``); None: ``d`` (any order).
        logit_roundings: roundings of a logit besides its dot product (query cast, scaling
            cast, the product by it, prescaling).
        dot_scale: multiplier of the dot product's rounding count (2 for tensor cores, whose
            FP32 accumulation may truncate instead of rounding).
        product_u: extra relative error of each product's two inputs (reduced-precision FP32
            matmul, :func:`matmul_input_rounding`).
        weight_u, weight_abs: relative / absolute rounding of each softmax weight before the
            value product (16-bit SDPA kernels round them to 16 bits; 0 otherwise).
    """

    exps: int
    depth: int
    depth_per_block: float = 0.0
    depth_per_token: float = 0.0
    exps_per_token: float = 0.0
    dot_depth: int | None = None
    logit_roundings: int = 3
    dot_scale: int = 1
    product_u: float = 0.0
    weight_u: float = 0.0
    weight_abs: float = 0.0

    def relative(self, n_blocks: int, n_tokens: int, u: float = U32) -> float:
        """Relative error of one term of a weighted sum, exponent arguments aside."""
        exps = self.exps + self.exps_per_token * n_tokens
        depth = self.depth + self.depth_per_block * n_blocks + self.depth_per_token * n_tokens
        return ((1 + EXP_ULPS * u) ** exps * (1 + gamma(depth, u))
                * (1 + self.product_u) ** 2 * (1 + self.weight_u) - 1)

    def logit_gamma(self, d: int, u: float = U32) -> float:
        """Relative error of a logit against ``sum_c |q_c k_c|`` (item 1)."""
        depth = d if self.dot_depth is None else self.dot_depth
        return gamma(self.dot_scale * depth + self.logit_roundings, u) + 2 * self.product_u

    def accumulation(self, n_blocks: int, n_tokens: int, u: float = U32) -> float:
        """Item 4: ``||O_hat - Obar|| <= this * V'`` for a softmax-weighted sum of ``n_tokens``
        values of norm at most ``V'``."""
        omega_den = self.relative(n_blocks, n_tokens, u) + _arg_rounding(n_tokens, u)
        omega_num = omega_den + self.weight_abs * n_tokens
        return (u + omega_den + (1 + u) * omega_num) / (1 - omega_den) + n_tokens * TINY


def _arg_rounding(n_tokens: int, u: float) -> float:
    """Weighted cost of rounded exp arguments (item 4): ``3 u log N`` (with higher orders)."""
    return ARG_ROUNDING * u * math.log(max(n_tokens, 2)) * math.exp(ARG_ROUNDING * u * NORMAL_EXP)


def _lse_rounding(terms: int, n_tokens: int, u: float) -> float:
    """Error of one computed log-sum-exp over ``terms`` inputs, rounding of the result aside
    (item 5): ``2 (omega_e + gamma_k + u log k) + 4 u log k``."""
    log_k = math.log(max(terms, 2))
    omega_e = EXP_ULPS * u + _arg_rounding(n_tokens, u)
    return 2 * (omega_e + gamma(terms, u) + u * log_k) + 4 * u * log_k


def _round_up_fp32(x: torch.Tensor) -> torch.Tensor:
    """Non-negative FP64 -> FP32, never below ``x``: rounding to nearest loses at most
    ``2^-24`` relatively (``2^-150`` absolutely), which the factor and the offset cover."""
    return (x * (1 + ROUND_UP_REL) + ROUND_UP_ABS).float()


def _widen(x: torch.Tensor, slack: torch.Tensor) -> torch.Tensor:
    """``x + slack + 8 u |x|`` (a computed log quantity plus its rounding allowance), written
    ``x (1 + 8 u sign x) + slack`` so that infinities stay as they are."""
    return x * (1 + LOG_ULPS * U32 * torch.sign(x)) + slack


FP16_MAX = 65504.0  # the largest FP16 key channel: sum_c K_c <= d * 65504 (finite keys)


def magnitude_factor(scaling: float, d: int) -> float:
    """``S``'s factor (:func:`logit_magnitude`): the scaling, rounded up by the FP64 dot
    product's own rounding over ``d`` channels."""
    return scaling * (1 + gamma(d + 2, 2.0**-53))


def logit_magnitude(q: torch.Tensor, key_abs_max: torch.Tensor, scaling: float):
    """``S = scaling sum_c |q_c| K_c`` per query head, FP64 ``[Hq]`` rounded up (item 1): it
    bounds ``scaling sum_c |q_c| |k_c|`` for every cached original key.

    Args:
        q: ``[Hq, d]``; key_abs_max: ``[Hkv, d]`` running channel max ``K_c`` of ``|k|``.
    """
    hkv, d = key_abs_max.shape
    s = torch.bmm(q.double().abs().view(hkv, -1, d), key_abs_max.double().unsqueeze(-1))
    return s.view(-1) * magnitude_factor(scaling, d)


def logit_rounding_form(spec_gamma: float, scaling: float,
                        d: int) -> tuple[float, float, float]:
    """:func:`logit_rounding` of an unscaled query as ``eps = a (S + Delta) + b Delta + c``:
    returns ``(a, b, c)``."""
    g_delta = gamma(d + 8)  # Delta_b: an FP32 sum, or scaling * ||q|| * key_err in FP32
    return spec_gamma * (1 + 2 * g_delta), 2 * g_delta, _underflow(scaling, d, 1.0)


def _underflow(scaling: float, d: int, prescale):
    """Item 1's absolute term: the subnormal underflow of a logit's products (with
    ``sum_c K_c <= d 65504``) for a query scaled by ``prescale``."""
    return scaling * TINY * d * (1 + FP16_MAX * prescale)


def logit_rounding(spec_gamma: float, magnitude, delta, scaling: float, d: int,
                   prescale=1.0):
    """``eps`` (item 1), FP64 ``[Hq]``: every computed logit is within ``eps`` of
    ``scaling q . k'`` (``k'`` the key the path used), and the exact ``Delta_b`` within
    ``eps`` above the computed one. ``spec_gamma``: :meth:`Rounding.logit_gamma`; magnitude:
    ``S``; delta: the head's computed max ``Delta_b`` (0 on the dense path); prescale: any
    factor the path scales the query by (its underflow, with ``sum_c K_c <= d 65504``)."""
    a, b, _ = logit_rounding_form(spec_gamma, scaling, d)
    return a * (magnitude + delta) + (b * delta + _underflow(scaling, d, prescale))


def cast_error(d: int, dtype: torch.dtype) -> tuple[float, float]:
    """Item 6: rounding an output of norm at most ``X`` to ``dtype`` moves it by at most
    ``a X + b``; returns ``(a, b)`` (0 when ``dtype`` holds every FP32 value)."""
    if dtype not in _HALF_SUBNORMAL:
        return 0.0, 0.0
    return unit_roundoff(dtype), math.sqrt(d) * _HALF_SUBNORMAL[dtype]


@dataclass(frozen=True)
class ArithSpec:
    """Static facts the bound needs (fixed for a layer and setting)."""

    head_dim: int
    block_size: int
    scaling: float
    mass_inflation: float  # c of eq. 14
    out_dtype: torch.dtype  # the caller's dtype (the output is cast to it)
    rounding: Rounding  # the backend's chain on the quantized path
    dense_rounding: Rounding  # the dense path's chain (rungs 3-4, mode=dense)
    dense_u: float = U32  # unit roundoff the dense path computes in (FP64 for FP64 queries)
    value_decode: float = 0.0  # the value codec's decode_rounding factor (item 3)


class StepCoefficients(NamedTuple):
    """The step's count-dependent scalars of the quantized path, computed on the host from ``n``
    blocks and ``N`` tokens (floats; 0-d device tensors for a compiled segment, so that a new
    count never recompiles it), and the weights of :func:`quantized_arith`'s linear form (FP64
    ``[7]`` on the device)."""

    kappa: float  # item 5 without the per-head magnitude part
    rho_rel: float  # item 5: relative error of a computed block mass
    spread_rel: float  # item 5: relative error of a computed block spread
    dense_acc: float  # item 4 of the dense path (rungs 3-4) over the step's N tokens
    weights: torch.Tensor  # composition_weights()


@lru_cache(maxsize=64)
def step_coefficients(spec: ArithSpec, n_blocks: int, n_tokens: int,
                      device: torch.device | str = "cpu") -> StepCoefficients:
    """:class:`StepCoefficients` of a quantized step over ``n_blocks`` and ``n_tokens``
    (memoised: every layer of a decode step asks for the same counts; read-only)."""
    log_n = math.log(max(n_tokens, 2))
    chained = 2 * _lse_rounding(spec.block_size, n_tokens, U32) + 2 * _lse_rounding(
        n_blocks, n_tokens, U32)
    omega = spec.rounding.relative(n_blocks, n_tokens) + math.expm1(
        ARG_ROUNDING * U32 * NORMAL_EXP)  # block masses: unweighted
    omega_rho = (2 * omega + U32) / (1 - omega)
    bsz = spec.block_size
    omega_spread = (3 * omega + gamma(bsz + 4) + bsz * TINY) / (1 - omega)
    val_rel = 1 / ((1 - gamma(n_blocks + 1)) * (1 - max(omega_rho, omega_spread))) - 1
    weights = composition_weights(spec, val_rel, n_blocks * TINY,
                                  spec.rounding.accumulation(n_blocks, n_tokens))
    return StepCoefficients(
        kappa=2 * chained + LOG_ULPS * U32 * (log_n + 1), rho_rel=omega_rho,
        spread_rel=omega_spread,
        dense_acc=spec.dense_rounding.accumulation(0, n_tokens, spec.dense_u),
        weights=memoised_tensor(weights, device))


def memoised_tensor(values: list[float], device) -> torch.Tensor:
    """FP64 ``values`` on ``device`` (one non-blocking copy) for a memoised result: made
    outside inference mode, so that steps in and outside it read the same kind of tensor (a
    compiled segment guards on it and would recompile for the other kind)."""
    with torch.inference_mode(False):
        return torch.tensor(values, dtype=torch.float64).to(device, non_blocking=True)


def composition_weights(spec: ArithSpec, val_rel: float, val_abs: float,
                        acc: float) -> list[float]:
    """Items 3, 4 and 6 and the composition as one linear form: ``e_arith = w . [E_key+, e_val,
    eta_max, sigma_max, V_max, ||O_hat||, 1] - e_key`` (:func:`quantized_arith`).

    With ``F = 1 + 4u``, the decode term ``c V + c0`` (item 3), ``V' = V + eta_max + c V + c0``
    (item 4's value magnitude), the cast ``a ||O_hat|| (1 + gamma_{d+1}) + b`` (item 6) and
    ``E_val+ = e_val (1 + val_rel) + val_abs (eta_max + sigma_max) + c V + c0`` (item 3), the
    bound ``F (E_key+ + E_val+ + acc V' + cast) + TINY (V' + 1) - e_key - e_val`` expands to
    these weights (host floats; one FP64 dot product per head at run time)."""
    d, f = spec.head_dim, 1 + 4 * U32
    c = spec.value_decode * U32
    c0 = c * math.sqrt(d) * 2.0**-24
    a, b = cast_error(d, spec.out_dtype)
    return [f,  # E_key+
            f * (1 + val_rel) - 1,  # e_val (E_val+ minus the returned e_val)
            f * (val_abs + acc) + TINY,  # eta_max: E_val+'s underflow, V'
            f * val_abs,  # sigma_max
            f * (c + acc * (1 + c)) + TINY * (1 + c),  # V_max: decode, V'
            f * a * (1 + gamma(d + 1)),  # ||O_hat||: the cast
            f * (c0 * (1 + acc) + b) + TINY * (1 + c0)]  # 1


@lru_cache(maxsize=64)
def as_tensors(coef: StepCoefficients, device) -> StepCoefficients:
    """The scalar coefficients as FP64 0-d tensors on ``device`` (one non-blocking copy, made
    once per memoised ``coef``: a step captured in a graph makes no host-to-device copy)."""
    packed = memoised_tensor(list(coef[:-1]), device)
    with torch.inference_mode(False):
        return StepCoefficients(*packed.unbind(), weights=coef.weights)


class LogitTerms(NamedTuple):
    """Item 1 and 5's per-head terms of a quantized step, FP64 ``[Hq]``: ``eps`` (every computed
    logit is within it of ``scaling q . k'``), ``kappa`` (a computed log-sum-exp's error) and
    ``g_delta`` (the relative error of a computed ``Delta_b`` or ``lambda_b``, a float)."""

    eps: torch.Tensor
    kappa: torch.Tensor
    g_delta: float


def logit_terms(spec: ArithSpec, coef: StepCoefficients, q: torch.Tensor,
                key_abs_max: torch.Tensor, delta: torch.Tensor) -> LogitTerms:
    """:class:`LogitTerms` for ``q [Hq, d]``, the running key maxima ``key_abs_max [Hkv, d]``
    and the head's computed max ``Delta_b`` (``delta [Hq]``, any float dtype)."""
    d = spec.head_dim
    magnitude = logit_magnitude(q, key_abs_max, spec.scaling)
    delta = delta.double()
    eps = logit_rounding(spec.rounding.logit_gamma(d), magnitude, delta, spec.scaling, d)
    return LogitTerms(eps, coef.kappa + LOG_ULPS * U32 * (magnitude + delta), gamma(d + 8))


def widened_blocks(coef: StepCoefficients, terms: LogitTerms, rho, spread, delta_b, lam,
                   not_tail):
    """Item 2's per-block inputs of :func:`~certkv.certify.bounds.block_tv_bound` for ``TV(p,
    m)``, ``m = softmax(s + x)`` with ``x`` the exact logit errors of the quantized keys on the
    INT8 tail (0 elsewhere); the caller adds ``tanh(eps/2) >= TV(m, p_hat)`` (every computed
    logit is within ``eps`` of ``s + x``). ``m_t <= e^{2 eps} p_hat_t``, so ``m``'s block masses
    and spreads are at most ``e^{2 eps}`` times upper bounds of ``p_hat``'s computed ones (item
    5); ``|x_t| <= Delta_b + eps`` and ``||x_b||_2 <= lambda_b (1 + 2 gamma)`` (item 1).
    ``block_tv_bound`` is monotone in each, so these upper bounds give a valid bound.

    Args (FP64 ``[Hq, n]``): ``rho, spread, delta_b, lam`` as computed; ``not_tail`` the blocks
    off the INT8 tail (bool). Returns ``(rho, D, lam, spread)`` widened, FP64 ``[Hq, n]``: ``D
    = Delta_b + eps`` on the tail (a computed 0 included: the exact ``Delta_b`` may be up to
    ``eps``) and 0 elsewhere, where the bound then reads nothing of the block.
    """
    eps = terms.eps.unsqueeze(-1)
    grow = torch.exp(2 * eps)  # [Hq, 1]
    rho_p = torch.addcmul(TINY * grow, rho, (1 + coef.rho_rel) * grow)
    spread_p = torch.addcmul(TINY * grow, spread, (1 + coef.spread_rel) * grow)
    d_p = (delta_b + eps).masked_fill(not_tail, 0.0)
    return rho_p, d_p, lam * (1 + 2 * terms.g_delta), spread_p


def widened_key_inputs(terms: LogitTerms, delta, delta_tail, log_alpha, cap_logit):
    """Item 2's per-head inputs of :func:`~certkv.certify.bounds.key_error_bound` (eq. 15 with
    rounded logits: ``Delta`` and ``Delta_T`` plus ``eps``, the computed log-sum-exps widened
    by their rounding ``kappa`` (``2 eps + 2 kappa`` for the difference of two), FP64 ``[Hq]``
    each (inputs any float dtype; infinities stay)."""
    eps, kappa = terms.eps, terms.kappa
    logs = _widen(torch.stack([log_alpha, cap_logit]).double(),
                  torch.stack([kappa, 2 * eps + 2 * kappa]))
    return delta.double() + eps, delta_tail.double() + eps, logs[0], logs[1]


def quantized_arith(coef: StepCoefficients, terms: LogitTerms, *, tv_plus, v_max, v_rad,
                    eta_max, sigma_max, e_key, e_val, out_norm) -> torch.Tensor:
    """``e_arith`` of the quantized path (rungs 0-2), FP32 ``[Hq]`` rounded up (items 1-6):
    ``E_key+ = 2 min(R, V_max) (tv_plus + tanh(eps / 2))`` (item 2) in the linear form of
    :func:`composition_weights`.

    Args (``[Hq]``): terms: :func:`logit_terms`; tv_plus: FP64, the total-variation bound at
    the widened inputs (:func:`widened_key_inputs`, :func:`widened_blocks`: item 2 without its
    ``tanh(eps/2)``); v_max; v_rad: the centred radius ``R`` E_key used; eta_max: the largest
    ``eta_b``; sigma_max: the largest value-error spectral norm of a block read quantized;
    e_key, e_val: the terms as returned; out_norm: ``||O_hat||`` (the FP32 output before the
    cast).
    """
    key_plus = 2 * torch.minimum(v_rad, v_max) * (tv_plus + torch.tanh(terms.eps / 2))
    parts = torch.stack([key_plus, e_val, eta_max, sigma_max, v_max, out_norm,
                         torch.ones_like(key_plus)])
    total = coef.weights @ parts - e_key
    return _round_up_fp32(total.clamp_min(0.0))


def dense_arith(spec: ArithSpec, n_tokens: int, *, q, key_abs_max, v_max,
                acc_coef=None) -> torch.Tensor:
    """``e_arith`` of the dense path (rungs 3-4, ``mode=dense``), FP32 ``[Hq]`` rounded up:
    logit rounding on every token (``2 V_max tanh(eps/2)``), the weighted sum and its
    normalisation, the cast (items 1, 4, 6). The dense path prescales ``q`` by a power of two
    ``<= 2 max(1, |q|_inf)``, whose subnormal underflow enters ``eps``. ``acc_coef``: item 4's
    coefficient for ``n_tokens`` when already computed (:attr:`StepCoefficients.dense_acc`,
    a 0-d tensor inside a compiled segment)."""
    d, u = spec.head_dim, spec.dense_u
    v = v_max.double()
    magnitude = logit_magnitude(q, key_abs_max, spec.scaling)
    prescale = 2 * q.double().abs().amax(dim=-1).clamp_min(1.0)
    eps = logit_rounding(spec.dense_rounding.logit_gamma(d, u), magnitude, 0.0, spec.scaling,
                         d, prescale)
    if acc_coef is None:
        acc_coef = spec.dense_rounding.accumulation(0, n_tokens, u)
    acc = acc_coef * v
    a, b = cast_error(d, spec.out_dtype)
    total = (2 * v * torch.tanh(eps / 2) + acc + a * (v + acc) + b) * (1 + 4 * U32) \
        + TINY * (v + 1)
    return _round_up_fp32(total)
