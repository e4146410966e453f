"""Certificates and their log (certkv.certify.certificate): a batch step's certificates logged
as lists give the records of the same certificates joined layer by layer."""

from __future__ import annotations

import pytest
import torch
from helpers import make_kv, make_query

from certkv import CertifiedAttention, TieredKVStore
from certkv.certify.certificate import Certificate, CertificateLog


def batch_steps(steps=2, layers=3, sequences=3):
    """Certificates ``[step][layer][sequence]`` of certified steps over stores of different
    lengths (one store per (layer, sequence), one token appended per step)."""
    attention, stores, kvs = CertifiedAttention(), {}, {}
    for layer in range(layers):
        for b in range(sequences):
            k, v = make_kv(2, 70 + 23 * b + steps, 16, seed=10 * layer + b)
            stores[layer, b] = TieredKVStore(2, 16)
            stores[layer, b].append(k[:, :-steps], v[:, :-steps])
            kvs[layer, b] = k, v
    out = []
    for t in range(steps):
        out.append([])
        for layer in range(layers):
            certs = []
            for b in range(sequences):
                k, v = kvs[layer, b]
                n = k.shape[1] - steps + t
                _, cert = attention(make_query(k[:, :n], 2, seed=t), stores[layer, b])
                cert.sequence = b
                certs.append(cert)
                stores[layer, b].append(k[:, n:n + 1], v[:, n:n + 1])
            out[-1].append(certs)
    return out


@pytest.mark.parametrize("keep", ["summary", "full"])
def test_a_batch_steps_certificates_logged_as_lists_give_the_joined_records(keep):
    steps = batch_steps()
    as_lists, joined = CertificateLog(keep), CertificateLog(keep)
    for layers in steps:
        for layer, certs in enumerate(layers):
            as_lists.record(layer, list(certs))
            joined.record(layer, Certificate.cat(certs))
    as_lists.flush(), joined.flush()
    assert len(as_lists.steps) == 2 and as_lists.steps[0]["layers"] == 3
    assert as_lists.steps[0]["heads"] == 3 * 3 * 4  # layers x sequences x query heads
    # a certificate joined over sequences keeps the largest block count: only the lists know
    # each sequence's own (the read share's denominators, the test below)
    without = [[{k: x for k, x in s.items() if k != "fp16_read_share"} for s in log.steps]
               for log in (as_lists, joined)]
    assert without[0] == without[1]
    assert as_lists.heads == joined.heads


def test_a_steps_fp16_read_share_weights_each_sequence_by_its_own_blocks():
    """Sequences of a batch hold different numbers of blocks: the step's share of the quantized
    cache read in FP16 is the reads over all heads against each head's own ``2 num_blocks``."""
    steps = batch_steps()
    log = CertificateLog()
    for layers in steps:
        for layer, certs in enumerate(layers):
            log.record(layer, list(certs))
    log.flush()
    for summary, layers in zip(log.steps, steps, strict=True):
        certs = [c for layer in layers for c in layer]
        assert len({c.num_blocks for c in certs}) > 1  # ragged: one denominator would be wrong
        read = sum(int(torch.where(c.rung >= 3, 2 * c.num_blocks, c.k_star + c.value_blocks)
                       .clamp(max=2 * c.num_blocks).sum()) for c in certs)
        whole = sum(2 * c.num_blocks * c.num_heads for c in certs)
        assert summary["fp16_read_share"] == pytest.approx(read / whole, rel=1e-12)
        assert 0.0 <= summary["fp16_read_share"] <= 1.0


def test_a_dense_step_reads_the_whole_cache_in_fp16():
    k, v = make_kv(2, 100, 16, seed=3)
    store = TieredKVStore(2, 16)
    store.append(k, v)
    log = CertificateLog()
    _, cert = CertifiedAttention(mode="dense")(make_query(k, 2, seed=4), store)
    log.record(0, cert)
    log.flush()
    assert log.steps[0]["fp16_read_share"] == 1.0
