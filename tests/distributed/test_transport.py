"""How dense rows travel between tiers (polyspec.orchestrator.distributed.transport): the encoding each
transport picks, and NCCL's device-to-device path (the rows never visit the host; a copy is sent, since a
captured step's output buffer is overwritten by the next replay).

The CPU tests drive `encode_rows` with a recording stand-in for torch.distributed; the CUDA test sends
rows between two processes on two GPUs over real NCCL and skips where fewer than two GPUs exist.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from polyspec.orchestrator.distributed.transport import Counters, DistChannel, decode_rows, encode_rows
from polyspec.protos.polyspec.v1 import tier_pb2


class _RecordingDist:
    """torch.distributed's isend / recv as far as DistChannel calls them: what was sent, by tag."""

    def __init__(self) -> None:
        self.sent: dict[int, torch.Tensor] = {}

    def isend(self, tensor, dst, tag):
        self.sent[tag] = tensor

        class _Done:
            @staticmethod
            def is_completed() -> bool:
                return True

        return _Done()

    def recv(self, buffer, src, tag):
        buffer.copy_(self.sent[tag])


def _channel(backend: str, min_bytes: int = 256 << 10) -> DistChannel:
    """A DistChannel of rank 0 in a world of 2 whose process group is the recording stand-in."""
    import itertools
    import threading

    channel = DistChannel.__new__(DistChannel)
    channel.backend, channel.rank, channel.min_bytes, channel.device = backend, 0, min_bytes, torch.device("cpu")
    channel._dist, channel._tags, channel.peers = _RecordingDist(), itertools.count(1), {1}
    channel._recv_lock, channel._pending, channel._pending_lock = threading.Lock(), [], threading.Lock()
    return channel


def _rows(num_rows: int, vocab: int, nonzero: int, seed: int = 0) -> torch.Tensor:
    """Probability rows with `nonzero` non-zero entries each (a top-k warp's shape)."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.zeros(num_rows, vocab)
    for r in range(num_rows):
        rows[r, torch.randperm(vocab, generator=generator)[:nonzero]] = torch.rand(nonzero, generator=generator) + 0.1
    return rows / rows.sum(dim=1, keepdim=True)


def test_gloo_and_inline_keep_their_choice_by_size_and_sparsity():
    counters = Counters()
    gloo = _channel("gloo", min_bytes=4 * 3 * 64)
    sparse, small_dense, big_dense = _rows(3, 64, 4), _rows(2, 64, 64), _rows(3, 64, 64)
    assert encode_rows(sparse, counters, gloo, dst=1).encoding == tier_pb2.Rows.SPARSE
    assert encode_rows(small_dense, counters, gloo, dst=1).encoding == tier_pb2.Rows.INLINE  # under min_bytes
    message = encode_rows(big_dense, counters, gloo, dst=1)
    assert message.encoding == tier_pb2.Rows.DIST
    for original in (sparse, small_dense, big_dense):
        assert torch.equal(decode_rows(encode_rows(original, counters, gloo, dst=1), gloo), original)
    assert encode_rows(big_dense, counters, gloo, dst=2).encoding == tier_pb2.Rows.INLINE  # not a peer: inline


def test_nccl_sends_every_block_dense_as_a_copy_and_decodes_on_the_channels_device():
    """Under NCCL even sparse and small rows go out of band (the host would cost a copy each way), and the
    tensor sent is a copy: overwriting the tier's buffer after the call must not change what arrives."""
    counters = Counters()
    nccl = _channel("nccl")
    for rows in (_rows(3, 64, 4), _rows(1, 16, 16)):
        buffer = rows.clone()  # the tier's output buffer
        message = encode_rows(buffer, counters, nccl, dst=1)
        assert message.encoding == tier_pb2.Rows.DIST and (message.num_rows, message.vocab) == tuple(rows.shape)
        sent = nccl._dist.sent[message.dist_tag]
        assert sent.data_ptr() != buffer.data_ptr() and sent.dtype == torch.float32
        buffer.fill_(0.0)  # the next replay overwrites the buffer
        received = decode_rows(message, nccl)
        assert torch.equal(received, rows) and received.device == nccl.device
    assert counters.bytes["nccl"] == 4 * (3 * 64 + 16)


def _nccl_peer(rank: int, init_file: str, vocab: int, result_file: str) -> None:  # pragma: no cover - runs on 2 GPUs
    torch.cuda.set_device(rank)
    channel = DistChannel("nccl", rank, 2, f"file://{init_file}")
    counters = Counters()
    rows = torch.softmax(torch.arange(3 * vocab, dtype=torch.float32, device="cuda").reshape(3, vocab) / vocab, dim=-1)
    if rank == 0:
        message = encode_rows(rows, counters, channel, dst=1)
        torch.save(message.SerializeToString(), result_file + ".message")
        torch.distributed.barrier()
    else:
        torch.distributed.barrier()
        message = tier_pb2.Rows.FromString(torch.load(result_file + ".message"))
        received = decode_rows(message, channel)
        torch.save({"device": str(received.device), "equal": bool(torch.equal(received, rows))}, result_file)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_nccl_rows_go_gpu_to_gpu_between_two_processes():
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        init_file, result_file = os.path.join(folder, "init"), os.path.join(folder, "result")
        mp.spawn(_nccl_peer, args=(init_file, 1000, result_file), nprocs=2, join=True)
        result = torch.load(result_file)
    assert result["equal"] and result["device"].startswith("cuda")
