"""Certificates and their log (certkv.certify.certificate): a batch step's certificates logged
as lists give the records of the same certificates joined layer by layer."""

from __future__ import annotations

import pytest
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
    assert as_lists.steps == joined.steps
    assert as_lists.heads == joined.heads
