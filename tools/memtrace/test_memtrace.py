#!/usr/bin/env python3
"""Tests of memtrace.py without a GPU: the allocator rounding the compiler also uses, and
tiny traced steps whose bytes can be counted by hand.

    python3 tools/memtrace/test_memtrace.py
"""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import memtrace as mt  # noqa: E402

MIB = 1 << 20


class Rounding(unittest.TestCase):
    def test_small_blocks_round_to_512(self):
        self.assertEqual(mt.allocated(1), 512)
        self.assertEqual(mt.allocated(512), 512)
        self.assertEqual(mt.allocated(513), 1024)

    def test_large_blocks_take_their_segment_when_the_leftover_is_small(self):
        # groundtruth xlmrxl_*: a 2560 x 2560 fp32 weight (exactly 25 MiB) takes 26 MiB.
        self.assertEqual(mt.allocated(25 * MIB), 26 * MIB)
        self.assertEqual(mt.allocated(24 * MIB), 24 * MIB)
        # Under 10 MiB a 20 MiB segment is split unless less than 1 MiB would be left.
        self.assertEqual(mt.allocated(2 * MIB), 2 * MIB)
        self.assertEqual(mt.allocated(19 * MIB + 1), 20 * MIB)


class Tracker(unittest.TestCase):
    def test_saved_tensors_live_until_their_backward(self):
        import torch
        x = torch.randn(1024, 256, device="meta", requires_grad=True)
        tracker = mt.StorageTracker()
        tracker.track(x, "input")
        with tracker:
            y = x.exp()  # saves its output: 1 MiB
            z = y.sum()
            del y
            self.assertEqual(tracker.current, 2 * MIB + 512)
            z.backward()
        del z
        # The gradient of x stays; exp's saved output is gone.
        self.assertEqual(tracker.current, 2 * MIB)
        self.assertEqual(tracker.peak, 3 * MIB + 512 + 512)

    def test_dropout_saves_a_one_byte_mask_as_on_cuda(self):
        import torch
        import torch.nn.functional as F
        x = torch.randn(1024, 1024, device="meta", dtype=torch.bfloat16, requires_grad=True)
        with mt.CudaKernels():
            y = F.dropout(x, 0.1, training=True)
        saved = y.grad_fn._saved_result1
        self.assertEqual(saved.dtype, torch.bool)


class Step(unittest.TestCase):
    def test_tiny_encoder_step_traces(self):
        c = mt.mp.normalize_config(dict(
            name="tiny", family="xlmr", hidden=64, layers=3, heads=4, intermediate=256,
            vocab=1000, max_pos=130, batch=4, seq=128, weight_dtype="bf16", autocast="none",
            attn="eager", loss="contrastive", dropout=0.1,
            lora=dict(r=4, alpha=8, targets=["query", "value"], dropout=0.1)))
        r = mt.trace(c, steps=2, top=5, device="meta")
        self.assertGreater(r["peak_tensor_B"], 0)
        # Layers are alike past the first (whose input needs no gradient).
        per_layer = r["saved_per_layer_B"]
        self.assertEqual(per_layer[1], per_layer[2])
        # Eager attention saves the bf16 probabilities, the dropout's 1-byte mask and its
        # bf16 output: 5 bytes a score, [4 seqs, 4 heads, 128, 128] of them.
        self.assertGreaterEqual(per_layer[1], 5 * 4 * 4 * 128 * 128)


if __name__ == "__main__":
    unittest.main()
