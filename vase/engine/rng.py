"""Counter-based random numbers: a row's draws are a pure function of (row key, row counter, stream, element).

One ``torch.Generator`` per row costs one RNG launch per row (per decode step for tokens, per layer at every
eviction for the policies' noise), and a generator's numbers depend on how many draws came before. A counter-based
generator — the idea behind cuRAND's Philox and JAX's threefry — computes element ``j`` of row ``b`` as a hash of
``(key[b], counter[b], stream, j)`` instead: the noise of every row is one batched tensor computation, nothing is
stateful, and a row's numbers do not depend on its batch-mates, on the batch size or on the device.

The engine keys the draws so that they never depend on anything batch-dependent:

* tokens: the row's token key (from its sample seed) and the absolute position of the token being sampled;
* evictions (:meth:`vase.engine.policy.EvictionInputs.rand` / ``randn``): the row's eviction key (the same seed,
  another salt), the row's absolute position at the eviction, the layer, and the index of the draw within the call.

The hash. :func:`mix32` is Chris Wellons' ``lowbias32`` (xor-shift, multiply, xor-shift, multiply, xor-shift; a
32-bit bijection with low avalanche bias), evaluated with int64 tensor ops on values kept in ``[0, 2^32)``: a
multiplication by a 32-bit constant ``c`` uses ``c - 2^32`` when ``c >= 2^31``, so no product leaves the int64 range
(two's complement makes ``(x * (c - 2^32)) & 0xFFFFFFFF`` equal to ``x * c mod 2^32``); no overflow, no undefined
behaviour, bit-identical on CPU and CUDA. Per call, two 32-bit round keys ``k1, k2`` are derived from the row's
64-bit key (two 32-bit words), its counter and the stream with chained :func:`mix32` on ``(B,)`` tensors (see
:meth:`RowRNG._round_keys`: two draws share round keys only if 64 bits collide); element
``j`` of the row is ``x = mix32(mix32(j ^ k1) ^ k2)`` — for a fixed row, a bijection of ``j`` (no repeated value
within a draw). A uniform is the top 23 bits centred: ``((x >> 9) + 1/2) / 2^23``, exactly representable in float32
and inside ``(0, 1)`` (never 0 or 1, so ``-log(u)`` is finite and positive); normals use Box–Muller on two uniforms.
``tests/test_rng.py`` checks uniformity, independence between neighbouring elements, counters, rows and streams,
and the normal's moments, on fixed keys (deterministic, so the tests cannot flake).

Cost per draw: about 25 elementwise int64 operations over the ``(B, n)`` noise and 35 over the ``(B, 2)`` round keys
(the two chains computed together), a fixed count whatever the number of rows (on CUDA a fixed set of small kernels
per draw instead of one RNG kernel per row). The compiled decode step (``generation.compile``) samples inside its
graph, where inductor fuses the token draw's hash into a few kernels.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

MASK32 = 0xFFFFFFFF
_C1 = 0x7FEB352D  # lowbias32's multipliers
_C2 = 0x846CA68B
#: salts of the two keys derived from a sample seed
TOKEN_SALT = 0x70CE_2A11
EVICT_SALT = 0x5EED_CAFE
_K1_SALT, _K2_SALT = 0x243F6A88, 0x85A308D3  # distinct chains for the two round keys (digits of pi)


def _signed(c: int) -> int:
    """``c`` or ``c - 2^32``: the same value mod ``2^32`` with ``|c| < 2^31`` (its products with x < 2^32 fit int64)."""
    return c - (1 << 32) if c >= 1 << 31 else c


_C1S, _C2S = _signed(_C1), _signed(_C2)


def mix32_int(x: int) -> int:
    """:func:`mix32` on a Python int (host side: keys and streams; the reference of the tensor version)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * _C1) & MASK32
    x ^= x >> 15
    x = (x * _C2) & MASK32
    x ^= x >> 16
    return x


def mix32(x: torch.Tensor) -> torch.Tensor:
    """Wellons' ``lowbias32`` on an int64 tensor of values in ``[0, 2^32)`` (returns a new tensor, same range)."""
    x = x ^ (x >> 16)
    x = (x * _C1S).bitwise_and_(MASK32)
    x = x.bitwise_xor_(x >> 15)
    x = (x * _C2S).bitwise_and_(MASK32)
    return x.bitwise_xor_(x >> 16)


def row_key(seed: int, salt: int) -> tuple[int, int]:
    """The 64-bit key (two 32-bit words) of a row from its sample seed (any int; 64 bits are used) and a salt."""
    lo, hi = seed & MASK32, (seed >> 32) & MASK32
    a = mix32_int(lo ^ mix32_int(hi ^ mix32_int(salt)))
    b = mix32_int(hi ^ mix32_int(a ^ mix32_int(salt ^ _K2_SALT)))
    return a, b


def row_keys(seeds: Sequence[int], salt: int) -> list[list[int]]:
    """:func:`row_key` of each seed, as ``[[a, b], ...]`` (ready for ``torch.tensor``)."""
    return [list(row_key(int(s), salt)) for s in seeds]


class RowRNG:
    """Random streams of a batch of rows: row ``b``'s numbers depend only on ``key[b]``, ``counter[b]`` and its stream.

    Args:
        key: ``(B, 2)`` int64, each row's key words in ``[0, 2^32)`` (:func:`row_key`).
        counter: ``(B,)`` int64 in ``[0, 2^32)``, e.g. the row's absolute position.
        stream: a host integer separating independent uses of the same (key, counter), e.g. the layer; or a ``(B,)``
            int64 tensor in ``[0, 2^32)``, each row's own stream (an eviction event draws for the rows of every layer
            at once, each with its layer as stream). Both give the same numbers: a row with stream tensor value ``s``
            draws exactly what it draws with the host integer ``s`` (the stream's hash moves from the host to the
            device, nothing else changes; ``tests/test_rng.py``).

    Each call of :meth:`uniform` / :meth:`normal` / :meth:`exponential` is a new draw (a draw index counted on the
    host, so the same sequence of calls on a row gives the same numbers whatever its batch-mates).
    """

    def __init__(self, key: torch.Tensor, counter: torch.Tensor, stream: int | torch.Tensor = 0):
        if key.dim() != 2 or key.shape[1] != 2 or counter.shape != key.shape[:1]:
            raise ValueError(
                f"RowRNG: key (B, 2) and counter (B,) expected, got {tuple(key.shape)} {tuple(counter.shape)}"
            )
        if isinstance(stream, torch.Tensor) and stream.shape != counter.shape:
            raise ValueError(f"RowRNG: a stream tensor must be (B,) like the counter, got {tuple(stream.shape)}")
        self.key, self.counter, self.stream = key, counter, stream
        self.draws = 0
        self._stream_hash: torch.Tensor | None = None

    @classmethod
    def from_seeds(
        cls, seeds: Sequence[int], counter: int = 0, stream: int = 0, salt: int = EVICT_SALT, device=None
    ) -> RowRNG:
        """Streams of rows with these seeds, all at ``counter`` (tests, analyses; the engine keeps device keys)."""
        key = torch.tensor(row_keys(seeds, salt), dtype=torch.long, device=device)
        return cls(key, torch.full((len(seeds),), counter, dtype=torch.long, device=device), stream)

    def _salts(self) -> tuple[int, int] | torch.Tensor:
        """This draw's ``(S1, S2)``: two host ints, or ``(B, 2)`` int64 for a stream tensor (the same values)."""
        d1, d2 = mix32_int(self.draws), mix32_int(self.draws ^ _K1_SALT)
        if not isinstance(self.stream, torch.Tensor):
            return (
                mix32_int(mix32_int(self.stream ^ _K1_SALT) ^ d1),
                mix32_int(mix32_int(self.stream ^ _K2_SALT) ^ d2),
            )
        if self._stream_hash is None:  # (B, 2): mix(stream ^ K1), mix(stream ^ K2), once per RowRNG
            salts = torch.tensor([_K1_SALT, _K2_SALT], dtype=torch.long, device=self.stream.device)
            self._stream_hash = mix32(self.stream[:, None].bitwise_xor(salts))
        d = torch.tensor([d1, d2], dtype=torch.long, device=self.stream.device)
        return mix32(self._stream_hash.bitwise_xor(d))

    def _round_keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k1, k2)``, each ``(B, 1)`` int64: this draw's round keys per row.

        ``m = mix(counter)``; ``k1 = mix(a ^ mix(m ^ S1))``, ``k2 = mix(b ^ mix(m ^ S2))`` with ``S1, S2`` two
        independent hashes of (stream, draw index): two draws of a row share round keys only if 64 bits collide.
        """
        salts = self._salts()
        self.draws += 1
        m = mix32(self.counter.bitwise_and(MASK32))
        if isinstance(salts, torch.Tensor):
            pre = m[:, None].bitwise_xor(salts)
        else:
            s1, s2 = salts
            pre = torch.stack((m ^ s1, m ^ s2), dim=1)
        # both chains in one (B, 2) computation: the same values as two (B,) ones, in 35 ops instead of 55
        k = mix32(self.key.bitwise_xor(mix32(pre)))
        return k[:, :1], k[:, 1:]

    def bits_at(self, j: torch.Tensor) -> torch.Tensor:
        """``(B, len(j))`` int64 hashes in ``[0, 2^32)`` of the elements ``j`` (a 1-d int64 tensor) of one draw:
        element ``j`` has the same value whatever the draw's size (a rank that holds some heads draws their part of
        the whole draw)."""
        k1, k2 = self._round_keys()
        return mix32(mix32(j.unsqueeze(0) ^ k1).bitwise_xor_(k2))

    @staticmethod
    def _span(shape: Sequence[int], heads: tuple[int, int] | None, device) -> tuple[torch.Tensor, int]:
        """The element indices of a draw of ``shape`` (``heads=(offset, total)``: its first axis is heads
        ``offset ..`` of ``total``, the part of a draw of ``(total, *shape[1:])``) and that whole draw's size."""
        n = math.prod(shape)
        if heads is None:
            return torch.arange(n, dtype=torch.long, device=device), n
        offset, total = heads
        rest = n // shape[0] if shape[0] else 0
        return torch.arange(offset * rest, offset * rest + n, dtype=torch.long, device=device), total * rest

    def uniform(self, *shape: int, heads: tuple[int, int] | None = None) -> torch.Tensor:
        """``(B, *shape)`` float32 uniform in ``(0, 1)`` (23 bits, centred: never 0 or 1).

        ``heads=(offset, total)``: ``shape[0]`` is a slice of heads from ``offset`` of ``total`` (tensor
        parallelism): the numbers are those rows ``offset ..`` of a draw of ``(total, *shape[1:])``."""
        j, _ = self._span(shape, heads, self.key.device)
        return self._uniform_at(j).view(-1, *shape)

    def normal(self, *shape: int, heads: tuple[int, int] | None = None) -> torch.Tensor:
        """``(B, *shape)`` float32 standard normal (Box–Muller on one draw of ``2 * numel`` uniforms); ``heads`` as
        in :meth:`uniform` (the slice of the whole draw's normals)."""
        n = math.prod(shape)
        j, whole = self._span(shape, heads, self.key.device)
        u = self._uniform_at(torch.cat((j, j + whole)))
        r = u[:, :n].log().mul_(-2.0).sqrt_()
        return r.mul_(torch.cos(u[:, n:] * (2 * math.pi))).view(-1, *shape)

    def _uniform_at(self, j: torch.Tensor) -> torch.Tensor:
        """``(B, len(j))`` float32 uniforms of the elements ``j`` of one draw (:meth:`bits_at`)."""
        x = self.bits_at(j)
        return (x >> 9).to(torch.float32).mul_(2.0**-23).add_(2.0**-24)

    def exponential(self, *shape: int) -> torch.Tensor:
        """``(B, *shape)`` float32 Exp(1) (``-log u``; in ``[2^-24, 16.7]``)."""
        return self.uniform(*shape).log_().neg_()
