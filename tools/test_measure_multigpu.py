#!/usr/bin/env python3
"""Tests of measure_multigpu.py that need no GPU: the default sweep, the
configuration checks, the DeepSpeed configuration, the rows rcoa validate
reads, and (when torch, transformers and peft are installed; DeepSpeed's
rows also need deepspeed) one configuration of each engine run at tiny size
on the CPU under the fake process group, each holding the shard of the
weights its engine gives rank 0. Run: python3 tools/test_measure_multigpu.py"""
import json
import os
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import measure_multigpu as mg  # noqa: E402
import measure_pytorch as mp  # noqa: E402
from test_measure_pytorch import ROOT, TINY, have_torch  # noqa: E402

SCRIPT = os.path.join(ROOT, "tools", "measure_multigpu.py")
MULTI = {**TINY, "heads": 8, "kv_heads": 8, "world_size": 4, "engine": "fsdp2"}


def have_deepspeed():
    try:
        import deepspeed  # noqa: F401
        return True
    except ImportError:
        return False


class Sweep(unittest.TestCase):
    def test_default_sweep_covers_every_engine_and_world_size(self):
        configs = [mg.normalize_config(c) for c in mg.default_sweep()]
        self.assertGreaterEqual(len(configs), 30)
        names = [c["name"] for c in configs]
        self.assertEqual(len(names), len(set(names)))
        by = {}
        for c in configs:
            by.setdefault(c["engine"], set()).add(c["world_size"])
        self.assertEqual(by["fsdp2"], {2, 4, 8, 16, 32, 64})
        self.assertEqual(by["tp"], {2, 4, 8})
        self.assertTrue(by["ddp"])
        self.assertEqual({c["zero_stage"] for c in configs if c["engine"] == "deepspeed"}, {0, 1, 2, 3})
        policies = {json.dumps(c["fsdp_mp"]) + c["weight_dtype"] for c in configs if c["engine"] == "fsdp2"}
        self.assertEqual(len(policies), 3)  # bf16/fp32 mixed precision, plain bf16, plain fp32

    def test_tiny_keeps_every_degree_dividing(self):
        for c in mg.default_sweep():
            t = mg.tiny(mg.normalize_config(c))
            self.assertEqual((t["hidden"], t["engine"], t["world_size"]),
                             (64, c["engine"], c["world_size"]))

    def test_list_prints_the_sweep(self):
        out = subprocess.run([sys.executable, SCRIPT, "--list", "--skip-engine", "deepspeed"],
                             capture_output=True, text=True)
        self.assertEqual(out.returncode, 0, out.stderr)
        rows = [json.loads(l) for l in out.stdout.splitlines()]
        self.assertTrue(rows and all(r["engine"] != "deepspeed" for r in rows))
        # What --list prints reads back as configurations.
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "sweep.jsonl")
            with open(p, "w") as f:
                f.write(out.stdout)
            self.assertEqual(mp.read_configs(p, normalize=mg.normalize_config), rows)


class Configs(unittest.TestCase):
    def test_defaults(self):
        c = mg.normalize_config(MULTI)
        self.assertEqual((c["tensor_parallel"], c["zero_stage"], c["reshard_after_forward"]), (1, None, True))
        t = mg.normalize_config({**MULTI, "engine": "tp"})
        self.assertEqual(t["tensor_parallel"], 4)

    def test_bad_configs_are_named(self):
        ds = {**MULTI, "engine": "deepspeed", "zero_stage": 2, "weight_dtype": "bf16",
              "autocast": "none", "master_weights": "fp32"}
        mg.normalize_config(ds)
        for bad, words in [
            ({**MULTI, "engine": "megatron"}, "engine"),
            ({k: v for k, v in MULTI.items() if k != "world_size"}, "missing world_size"),
            ({**MULTI, "world_size": 0}, "world_size"),
            ({**MULTI, "engine": "tp", "world_size": 3}, "not divisible by tensor_parallel 3"),
            ({**MULTI, "engine": "tp", "world_size": 1}, "world_size >= 2"),
            ({**MULTI, "engine": "ddp", "tensor_parallel": 2}, "only tp"),
            ({**MULTI, "sequence_parallel": True}, "sequence_parallel"),
            ({**MULTI, "zero_stage": 3}, "DeepSpeed"),
            ({**ds, "zero_stage": 4}, "stages are 0-3"),
            ({**ds, "optimizer": "sgd"}, "adamw"),
            ({**ds, "grad_accum": 2}, "grad_accum 1"),
            ({**ds, "master_weights": "none"}, "master_weights fp32"),
            ({**MULTI, "engine": "ddp", "fsdp_mp": {"param_dtype": "bf16", "reduce_dtype": "fp32"}},
             "FSDP2's"),
            ({**MULTI, "fsdp_mp": {"param_dtype": "fp16", "reduce_dtype": "fp32"}}, "fsdp_mp"),
            ({**MULTI, "reshard_after_forward": False}, "reshard_after_forward"),
            ({**MULTI, "family": "xlmr", "kv_heads": 8}, "Llama"),
        ]:
            with self.assertRaises(mp.ConfigError) as cm:
                mg.normalize_config(bad)
            self.assertIn(words, str(cm.exception))
            self.assertIn("tiny", str(cm.exception))

    def test_deepspeed_config(self):
        c = mg.normalize_config({**MULTI, "engine": "deepspeed", "zero_stage": 3, "weight_dtype": "bf16",
                                 "autocast": "none", "master_weights": "fp32"})
        ds = mg.deepspeed_config(c)
        self.assertEqual(ds["zero_optimization"], {"stage": 3})
        self.assertTrue(ds["bf16"]["enabled"])
        self.assertTrue(ds["optimizer"]["params"]["torch_adam"])
        self.assertEqual(ds["train_micro_batch_size_per_gpu"], c["batch"])
        fused = mg.deepspeed_config({**c, "optimizer": "adamw_fused"})
        self.assertNotIn("torch_adam", fused["optimizer"]["params"])

    def test_dry_run_needs_no_torch_run(self):
        out = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--only", "deepspeed_z3_n32"],
                             capture_output=True, text=True)
        self.assertEqual(out.returncode, 0, out.stderr)
        row = json.loads(out.stdout)
        self.assertEqual((row["engine"], row["world_size"]), ("deepspeed", 32))
        self.assertEqual(row["deepspeed"]["zero_optimization"]["stage"], 3)
        bad = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--only", "nope"],
                             capture_output=True, text=True)
        self.assertEqual(bad.returncode, 2)
        self.assertIn("no configuration named nope", bad.stderr)


class Rows(unittest.TestCase):
    def test_sweep_rows_are_what_rcoa_validate_reads(self):
        rcoa = os.environ.get("RCOA", os.path.join(ROOT, "target", "debug", "rcoa"))
        if not os.path.exists(rcoa):
            self.skipTest("no rcoa binary (set RCOA)")
        phases = [{"phase": "fwd0", "ms": 1.0, "peak_B": 20 << 30, "alloc_B": 1,
                   "reserved_peak_B": 21 << 30, "reserved_B": 1}]
        configs = [mg.normalize_config(c) for c in mg.default_sweep()]
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "rows.jsonl")
            with open(p, "w") as f:
                f.write(json.dumps({"record": "env", "fake_process_group": True}) + "\n")
                for c in configs:
                    steps = [{"step": 1, "complete": True, "phases": [dict(x) for x in phases]}]
                    f.write(json.dumps(mg.summarize(c, steps, {"device": "cuda"})) + "\n")
            out = subprocess.run([rcoa, "validate", p, "--format", "json"], capture_output=True, text=True)
        # 1: some rows did not compile (the fsdp and deepspeed targets before the
        # compiler has them); never 2, a file it cannot read.
        self.assertIn(out.returncode, (0, 1), out.stderr)
        rows = {r["name"]: r for r in map(json.loads, out.stdout.splitlines()) if r["record"] == "row"}
        self.assertEqual(set(rows), {c["name"] for c in configs})
        for c in configs:
            r = rows[c["name"]]
            if c["engine"] in ("ddp", "tp"):
                self.assertEqual(r["status"], "scored", r)
            elif r["status"] == "failed":
                self.assertEqual(r["stage"], "resolve", r)
                self.assertIn({"fsdp2": "fsdp", "deepspeed": "deepspeed"}[c["engine"]], r["message"])
            else:
                self.assertEqual(r["status"], "scored", r)


@unittest.skipUnless(have_torch(), "torch, transformers and peft are not installed")
class OnTheCpu(unittest.TestCase):
    """One configuration of each engine, run by the script itself at tiny size."""

    @classmethod
    def setUpClass(cls):
        names = ["fsdp2_mp_n8", "ddp_bf16_n8", "tp_bf16_n4"]
        if have_deepspeed():
            names += ["deepspeed_z3_n8"]
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "cpu.jsonl")
            cls.proc = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "-o", p, "--jobs", "2",
                                       "--only", *names], capture_output=True, text=True)
            with open(p) as f:
                lines = [json.loads(l) for l in f]
        cls.env = lines[0]
        cls.order = [r["name"] for r in lines[1:]]
        cls.rows = {r["name"]: r for r in lines[1:]}
        cls.names = names

    def test_every_configuration_ran(self):
        self.assertEqual(self.proc.returncode, 0, self.proc.stderr[-3000:])
        self.assertEqual(self.env["record"], "env")
        # Two at a time, written in the sweep's order.
        sweep = [c["name"] for c in mg.default_sweep() if c["name"] in self.names]
        self.assertEqual(self.order, sweep)
        self.assertTrue(self.env["fake_process_group"])
        for name, r in self.rows.items():
            self.assertEqual(r["status"], "cpu", (name, r.get("error")))
            self.assertEqual(r["concurrent_jobs"], 2)
            self.assertIsNone(r["peak_train_B"])  # the CPU has no allocator peaks
            self.assertEqual([p["phase"] for p in r["steps"][-1]["phases"]], ["fwd0", "bwd0", "opt", "zero"])
            self.assertTrue(all(s["complete"] for s in r["steps"]))

    def test_rank_0_holds_its_engines_share_of_the_weights(self):
        fsdp = self.rows["fsdp2_mp_n8"]
        # fp32 shards: an eighth of each tensor, rounded up per tensor.
        self.assertLess(fsdp["param_bytes_local"], fsdp["param_bytes"] / 8 * 1.1)
        self.assertGreaterEqual(fsdp["param_bytes_local"], fsdp["param_bytes"] / 8)
        ddp = self.rows["ddp_bf16_n8"]
        self.assertEqual(ddp["param_bytes_local"], ddp["param_bytes"])
        self.assertEqual(ddp["ddp_bucket_cap_mb"], 25)
        tp = self.rows["tp_bf16_n4"]
        # Every projection, the embedding and the head are split four ways; the norms are whole.
        self.assertLess(tp["param_bytes_local"], tp["param_bytes"] / 4 * 1.05)
        self.assertGreater(tp["param_bytes_local"], tp["param_bytes"] / 4)

    def test_the_script_holds_no_parameter_its_engine_replaced(self):
        # Else rank 0 would keep the whole unsharded model beside its shards.
        for name, r in self.rows.items():
            self.assertTrue(r["built_params_released"], name)
            self.assertEqual(r["built_params_still_held"], 0, name)

    @unittest.skipUnless(have_deepspeed(), "deepspeed is not installed")
    def test_deepspeed_zero3_partitions_the_weights(self):
        ds = self.rows["deepspeed_z3_n8"]
        self.assertLessEqual(ds["param_bytes_local"], ds["param_bytes"] / 8 * 1.1)
        self.assertGreater(ds["param_bytes_local"], 0)
        self.assertEqual(ds["deepspeed_config"]["zero_optimization"]["stage"], 3)


if __name__ == "__main__":
    unittest.main()
