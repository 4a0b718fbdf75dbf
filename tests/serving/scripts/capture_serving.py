"""Capture a tiny real model serving or training on the CPU with torch.profiler (for the tests).

    python capture_serving.py OUTDIR MODE...

MODE: generate | generate_nostack | generate_steps | train | cb | cb_stall (the cb modes last: they
patch the engine).
Writes OUTDIR/MODE.json.gz and OUTDIR/MODE.truth.json: what the program knows itself (tokens
asked for, the engine's own step count and per-step batch), for the tests to compare with what
aiprof finds in the trace. One process for all modes: importing transformers is most of the time.
"""
from __future__ import annotations

import gzip
import json
import os
import shutil
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile, schedule

torch.manual_seed(0)
torch.set_num_threads(1)
OUT = sys.argv[1]
NEW_TOKENS = 12
TRACE = ""


def save(p) -> None:
    fd, tmp = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    p.export_chrome_trace(tmp)
    with open(tmp, "rb") as a, gzip.open(TRACE, "wb") as b:
        shutil.copyfileobj(a, b)
    os.unlink(tmp)


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=256, bos_token_id=1, eos_token_id=2)
    return GPT2LMHeadModel(cfg).eval()


def generate(stack: bool) -> dict:
    m = gpt2()
    ids = torch.randint(3, 500, (4, 10))
    att = torch.ones_like(ids)
    att[0, :4] = 0  # mixed prompt lengths, left-padded
    kw = {"attention_mask": att, "max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False,
          "pad_token_id": 0}
    m.generate(ids, **kw)  # warm-up
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=stack) as p:
        m.generate(ids, **kw)
    save(p)
    return {"batch": 4, "prompt": 10, "new_tokens": NEW_TOKENS, "forwards": NEW_TOKENS}


def generate_steps() -> dict:
    m = gpt2()
    ids = torch.randint(3, 500, (2, 8))
    kw = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": 0}
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True,
                 schedule=schedule(wait=0, warmup=1, active=2, repeat=1), on_trace_ready=save) as p:
        for _ in range(3):
            m.generate(ids, **kw)
            p.step()
    return {"batch": 2, "new_tokens": NEW_TOKENS, "profiler_steps": 2, "forwards": 2 * NEW_TOKENS}


def cb() -> dict:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching import continuous_api as ca
    from transformers.generation.continuous_batching import scheduler as sch

    cfg = LlamaConfig(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512)
    m = LlamaForCausalLM(cfg).eval()
    gc = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cbc = ContinuousBatchingConfig(max_batch_tokens=64, num_blocks=32, page_size=32, auto_switch_to_flash=False)
    prompts = [torch.randint(1, 500, (n,)).tolist() for n in (5, 17, 40, 9, 60, 3, 25, 11)]
    steps = []
    for cls in {c for c in vars(sch).values() if isinstance(c, type) and "schedule_batch" in vars(c)}:
        orig = cls.schedule_batch

        def wrapped(self, *a, __orig=orig, **k):
            res = __orig(self, *a, **k)
            if res[0]:  # the engine's own view: a request that has generated tokens decodes
                q = [fs.query_length for fs in res[0]]
                dec = [fs.state.generated_len() > 0 for fs in res[0]]
                steps.append({"requests": len(q), "q_tokens": sum(q), "prefill": dec.count(False),
                              "decode": dec.count(True), "new_tokens": sum(fs.has_new_token for fs in res[0])})
            return res

        cls.schedule_batch = wrapped
    orig_loop = ca.ContinuousBatchingManager._run_generation_loop
    seen = {}

    # A private method: wrapped with *a/**k so that a release changing its signature still runs
    # (5.24 added use_inference_mode=).
    def loop(self, *a, **k):  # the profiler records the host ops of the thread that starts it
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True) as p:
            orig_loop(self, *a, **k)
        save(p)
        seen["engine_steps"] = self.current_batch

    loop._aiprof_orig = orig_loop
    ca.ContinuousBatchingManager._run_generation_loop = loop
    out = m.generate_batch(prompts, generation_config=gc, continuous_batching_config=cbc)
    return {"engine_steps": seen["engine_steps"], "steps": steps, "requests": len(prompts),
            "tokens": sum(len(o.generated_tokens) for o in out.values())}


def cb_stall() -> dict:
    """Three sequences decode; once the engine has run a few decode steps a long prompt arrives and
    is processed whole (the token budget admits it) beside them: a prefill that stalls decode."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching import continuous_api as ca
    from transformers.generation.continuous_batching import scheduler as sch

    cfg = LlamaConfig(vocab_size=500, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    m = LlamaForCausalLM(cfg).eval()
    gc = GenerationConfig(max_new_tokens=24, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cbc = ContinuousBatchingConfig(max_batch_tokens=2048, num_blocks=64, page_size=64, auto_switch_to_flash=False)
    steps = []
    for cls in {c for c in vars(sch).values() if isinstance(c, type) and "schedule_batch" in vars(c)}:
        if getattr(cls.schedule_batch, "_aiprof_test", False):
            continue
        orig = cls.schedule_batch

        def wrapped(self, *a, __orig=orig, **k):
            res = __orig(self, *a, **k)
            if res[0]:
                dec = [fs.state.generated_len() > 0 for fs in res[0]]
                steps.append({"requests": len(dec), "prefill": dec.count(False), "decode": dec.count(True)})
            return res

        wrapped._aiprof_test = True
        cls.schedule_batch = wrapped
    seen = {}
    orig_loop = ca.ContinuousBatchingManager.__dict__["_run_generation_loop"]
    orig_loop = getattr(orig_loop, "_aiprof_orig", orig_loop)

    def loop(self, *a, **k):
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True) as p:
            orig_loop(self, *a, **k)
        save(p)
        seen["engine_steps"] = self.current_batch

    loop._aiprof_orig = orig_loop
    ca.ContinuousBatchingManager._run_generation_loop = loop
    mgr = m.init_continuous_batching(generation_config=gc, continuous_batching_config=cbc)
    mgr.start()
    for n in (6, 9, 5):
        mgr.add_request(torch.randint(1, 500, (n,)).tolist(), max_new_tokens=24)
    while len(steps) < 5:  # decoding has started
        import time

        time.sleep(0.005)
    mgr.add_request(torch.randint(1, 500, (1024,)).tolist(), max_new_tokens=4)
    got = 0
    while got < 4:
        r = mgr.get_result(timeout=30)
        got += r is not None and r.is_finished()
    mgr.stop(block=True, timeout=30)
    return {"engine_steps": seen.get("engine_steps"), "steps": steps}


def train() -> dict:
    """A training loop with no ProfilerStep and no torch.optim (a hand-written SGD update)."""
    m = gpt2().train()
    x = torch.randint(3, 500, (2, 16))
    n = 5
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as p:
        for _ in range(n):
            loss = m(x, labels=x).loss
            loss.backward()
            with torch.no_grad():
                for w in m.parameters():
                    w -= 1e-3 * w.grad
                    w.grad = None
    save(p)
    return {"iterations": n}


MODES = {"generate": lambda: generate(True), "generate_nostack": lambda: generate(False),
         "generate_steps": generate_steps, "train": train, "cb": cb, "cb_stall": cb_stall}
for mode in sys.argv[2:]:
    TRACE = os.path.join(OUT, f"{mode}.json.gz")
    truth = MODES[mode]()
    with open(os.path.join(OUT, f"{mode}.truth.json"), "w") as f:
        json.dump(truth, f)
