#!/usr/bin/env python3
"""Tests of measure_pytorch.py that need no GPU: configuration checks, the
transformers/PEFT arguments, the row format rcoa validate reads, and (when
torch, transformers and peft are installed) building and stepping tiny
models on the CPU. Run: python3 tools/test_measure_pytorch.py"""
import json
import os
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import measure_pytorch as mp  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GROUNDTRUTH = os.path.join(ROOT, "tests", "groundtruth", "h100-pytorch.jsonl")

TINY = {"name": "tiny", "family": "llama", "hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2,
        "intermediate": 128, "vocab": 256, "max_pos": 128, "batch": 2, "seq": 16}


def have_torch():
    try:
        import peft  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401
        return True
    except ImportError:
        return False


class Configs(unittest.TestCase):
    def test_defaults(self):
        c = mp.normalize_config(TINY)
        self.assertEqual(c["grad_accum"], 1)
        self.assertEqual(c["loss"], "lm")
        self.assertFalse(c["tie_embeddings"])
        self.assertEqual(c["steps"], 3)
        e = mp.normalize_config({**TINY, "family": "xlmr", "kv_heads": 4})
        self.assertEqual(e["loss"], "mlm")
        self.assertTrue(e["tie_embeddings"])

    def test_every_groundtruth_config_is_accepted(self):
        configs = mp.read_configs(GROUNDTRUTH)
        self.assertEqual(len(configs), 48)
        for c in configs:
            self.assertEqual(mp.normalize_config(c), c)

    def test_bad_configs_are_named(self):
        for bad, words in [
            ({**TINY, "optimizer": "lion"}, "optimizer"),
            ({**TINY, "heads": 3}, "divisible"),
            ({k: v for k, v in TINY.items() if k != "vocab"}, "missing vocab"),
            ({**TINY, "batch": 0}, "batch"),
            ({**TINY, "family": "xlmr"}, "kv_heads"),
            ({**TINY, "loss": "contrastive", "batch": 3}, "even"),
            ({**TINY, "lora": {"r": 8}}, "lora needs alpha"),
        ]:
            with self.assertRaises(mp.ConfigError) as cm:
                mp.normalize_config(bad)
            self.assertIn(words, str(cm.exception))
            self.assertIn("tiny", str(cm.exception))

    def test_read_configs_takes_lists_and_rows(self):
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "c.json")
            with open(p, "w") as f:
                json.dump([TINY, {**TINY, "name": "b"}], f)
            self.assertEqual([c["name"] for c in mp.read_configs(p)], ["tiny", "b"])
            with open(p, "w") as f:
                f.write(json.dumps(TINY) + "\n" + json.dumps(TINY) + "\n")
            with self.assertRaises(mp.ConfigError):
                mp.read_configs(p)  # repeated name
            with open(p, "w") as f:
                f.write("{oops\n")
            with self.assertRaisesRegex(mp.ConfigError, ":1: not JSON"):
                mp.read_configs(p)


class Arguments(unittest.TestCase):
    def test_model_and_adapter_arguments(self):
        c = mp.normalize_config({**TINY, "lora": {"r": 8, "alpha": 16, "targets": ["q_proj"]}})
        cls, kw = mp.model_config_kwargs(c)
        self.assertEqual(cls, "LlamaForCausalLM")
        self.assertEqual(kw["num_key_value_heads"], 2)
        self.assertEqual(mp.lora_kwargs(c)["lora_dropout"], 0.0)
        cls, kw = mp.model_config_kwargs(mp.normalize_config({**TINY, "family": "xlmr", "kv_heads": 4}))
        self.assertEqual(cls, "XLMRobertaForMaskedLM")
        self.assertNotIn("num_key_value_heads", kw)

    def test_checkpointed_layers_and_phases(self):
        c = mp.normalize_config({**TINY, "layers": 5, "grad_ckpt": True, "ckpt_every": 2})
        self.assertEqual(mp.checkpointed_layers(c), [0, 2, 4])
        self.assertEqual(mp.checkpointed_layers(mp.normalize_config(TINY)), [])
        self.assertEqual(mp.phase_names(2), ["fwd0", "bwd0", "fwd1", "bwd1", "opt", "zero"])


def phase(name, peak, alloc=10):
    return {"phase": name, "ms": 1.0, "peak_B": peak, "alloc_B": alloc,
            "reserved_peak_B": peak + 5, "reserved_B": peak}


class Rows(unittest.TestCase):
    def test_peak_train_is_the_highest_phase_over_the_steps(self):
        c = mp.normalize_config(TINY)
        steps = [{"step": 1, "complete": True, "phases": [phase("fwd0", 100), phase("bwd0", 120)]},
                 {"step": 2, "complete": True, "phases": [phase("fwd0", 150), phase("bwd0", 130)]}]
        row = mp.summarize(c, steps, {"device": "cuda"})
        self.assertEqual(row["record"], "config")
        self.assertEqual(row["status"], "ok")
        self.assertFalse(row["oom"])
        self.assertEqual(row["peak_train_B"], 150)
        self.assertEqual(row["peak_phase_step2"], "fwd0")
        self.assertEqual(row["reserved_peak_train_B"], 155)
        self.assertEqual(row["config"], c)

    def test_oom_row(self):
        c = mp.normalize_config(TINY)
        steps = [{"step": 1, "complete": False, "phases": [phase("fwd0(failed)", 900)]}]
        row = mp.summarize(c, steps, {"oom": True, "oom_phase": "step1.fwd0", "error": "OutOfMemoryError: x"})
        self.assertEqual((row["status"], row["oom"], row["oom_phase"]), ("oom", True, "step1.fwd0"))
        self.assertIsNone(row["tokens_per_s"])

    def test_rows_are_what_rcoa_validate_reads(self):
        rcoa = os.environ.get("RCOA", os.path.join(ROOT, "target", "debug", "rcoa"))
        if not os.path.exists(rcoa):
            self.skipTest("no rcoa binary (set RCOA)")
        c = mp.normalize_config({**TINY, "hidden": 512, "heads": 8, "kv_heads": 8, "layers": 4,
                                 "intermediate": 1024, "vocab": 32000, "max_pos": 2048,
                                 "batch": 4, "seq": 512})
        steps = [{"step": 1, "complete": True, "phases": [phase("fwd0", 2 << 30)]}]
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "rows.jsonl")
            with open(p, "w") as f:
                f.write(json.dumps({"record": "env"}) + "\n")
                f.write(json.dumps(mp.summarize(c, steps, {})) + "\n")
            out = subprocess.run([rcoa, "validate", p], capture_output=True, text=True)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("accuracy: n=1 ", out.stdout)


@unittest.skipUnless(have_torch(), "torch, transformers and peft are not installed")
class OnTheCpu(unittest.TestCase):
    def step(self, **over):
        import torch
        c = mp.normalize_config({**TINY, **over})
        model = mp.build_model(c, "cpu")
        params = [p for p in model.parameters() if p.requires_grad]
        opt = mp.make_optimizer(c, params)
        ids = torch.randint(3, c["vocab"], (c["batch"], c["seq"]))
        loss = mp.loss_of(c, model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        self.assertTrue(torch.isfinite(loss))
        return model

    def test_llama_with_lora_and_checkpointing(self):
        import torch
        m = self.step(lora={"r": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]},
                      grad_ckpt=True, ckpt_every=2, weight_dtype="bf16", layers=3)
        layers = mp.encoder_layers(m)
        self.assertEqual([l.gradient_checkpointing for l in layers], [True, False, True])
        lora = [p for n, p in m.named_parameters() if "lora_" in n]
        self.assertTrue(lora and all(p.dtype == torch.float32 for p in lora))
        self.assertTrue(all(not p.requires_grad for n, p in m.named_parameters() if "lora_" not in n))

    def test_measure_runs_every_phase_of_every_step(self):
        import math
        c = mp.normalize_config({**TINY, "grad_accum": 2, "steps": 2})
        row = mp.measure(c, "cpu")
        self.assertEqual((row["status"], row["device"]), ("ok", "cpu"))
        self.assertEqual([s["step"] for s in row["steps"]], [1, 2])
        for s in row["steps"]:
            self.assertTrue(s["complete"])
            self.assertEqual([p["phase"] for p in s["phases"]], mp.phase_names(2))
            self.assertTrue(math.isfinite(s["loss"]))
        self.assertEqual(row["params_trainable"], row["params_total"])
        self.assertEqual(row["tokens_per_step"], 2 * 16 * 2)

    def test_xlmr_mlm_and_contrastive(self):
        x = {"family": "xlmr", "kv_heads": 4, "max_pos": 32}
        self.step(**x, optimizer="adafactor")
        self.step(**x, loss="contrastive", optimizer="sgd_momentum")


if __name__ == "__main__":
    unittest.main()
