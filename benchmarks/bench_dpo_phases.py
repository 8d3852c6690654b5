"""Where a DPO step's time goes, lmforge against TRL 1.16's DPOTrainer, on the same 8 pairs.

The workload of bench_dpo_vs_trl.py (SmolLM2-135M-Instruct, chat pairs from chat_small.jsonl, beta 0.1,
fp32, no activation checkpointing, 1 torch thread), three batches of 8 pairs (lmforge's first batch
order, fed to both). TRL: the policy and reference forwards (timed inside ``compute_loss``), the
backward, clip + its AdamW; lmforge: ``dpo.reference_logps``, ``dpo.micro_loss`` (the policy forward
inside), the backward, ``updater.step`` (clip + AdamW). Prints the layouts (TRL's padded batch,
lmforge's packed rows) and seconds per phase.

    python benchmarks/bench_dpo_phases.py
"""

import copy
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
os.environ["TOKENIZERS_PARALLELISM"] = "false"
import torch  # noqa: E402

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_dpo_vs_trl as B  # noqa: E402

from lmforge.core.config import ModelConfig  # noqa: E402
from lmforge.data.preference import tokenize_pairs  # noqa: E402
from lmforge.model.load import load_model  # noqa: E402
from lmforge.recipes import dpo  # noqa: E402
from lmforge.runtime.optim import BatchOrder  # noqa: E402
from lmforge.supervised import pair_forward  # noqa: E402

model, tok = load_model(ModelConfig(name="smollm2-135m-instruct"))
rows = B.pair_rows()
data = tokenize_pairs(rows, tok, B.MAX_LEN)
order = BatchOrder(len(data), 8, 0)
batches = [order.next() for _ in range(3)]

out = tempfile.mkdtemp()
# --- TRL (its own fused LM head: log-probs, entropy, mean logits, top-1 at every position on CPU)
from datasets import Dataset  # noqa: E402
from trl import DPOConfig, DPOTrainer  # noqa: E402

cfg = DPOConfig(
    output_dir=out + "/trl",
    per_device_train_batch_size=8,
    learning_rate=B.LR,
    beta=B.BETA,
    loss_type=["sigmoid"],
    max_length=B.MAX_LEN,
    max_steps=1,
    max_grad_norm=1.0,
    weight_decay=0.0,
    report_to=[],
    use_cpu=True,
    dataloader_num_workers=0,
    seed=0,
    bf16=False,
    gradient_checkpointing=False,
    save_strategy="no",
)
trainer = DPOTrainer(model=copy.deepcopy(model), args=cfg, train_dataset=Dataset.from_list(rows), processing_class=tok)
trainer.create_optimizer_and_scheduler(10)
print("TRL optimizer", type(trainer.optimizer).__name__, trainer.args.optim)
T = {}


def timed(obj, key):
    f = obj.forward

    def g(*a, **k):
        t = time.perf_counter()
        r = f(*a, **k)
        T[key] = T.get(key, 0) + time.perf_counter() - t
        return r

    obj.forward = g


timed(trainer.model, "trl policy forward")
timed(trainer.ref_model, "trl reference forward")
trainer.model.train()
for rep, idx in enumerate(batches):
    inputs = trainer.data_collator([trainer.train_dataset[i] for i in list(idx)])
    if rep == 0:
        print("TRL batch", tuple(inputs["input_ids"].shape))
    T0 = dict(T)
    t = time.perf_counter()
    loss = trainer.compute_loss(trainer.model, inputs)
    tl = time.perf_counter() - t
    t = time.perf_counter()
    loss.backward()
    tb = time.perf_counter() - t
    t = time.perf_counter()
    torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), 1.0)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad()
    to = time.perf_counter() - t
    print(
        f"TRL pairs {rep}: policy fwd {T['trl policy forward'] - T0.get('trl policy forward', 0):.2f} ref fwd "
        f"{T['trl reference forward'] - T0.get('trl reference forward', 0):.2f} compute_loss {tl:.2f} backward "
        f"{tb:.2f} clip+adamw {to:.2f} total {tl + tb + to:.2f}",
        flush=True,
    )
del trainer
# --- lmforge
from lmforge.core.config import OptimConfig, TrainConfig  # noqa: E402
from lmforge.runtime.loop import build_state  # noqa: E402
from lmforge.runtime.run import start_run  # noqa: E402

lcfg = dpo.DPOConfig(
    model=ModelConfig(name="smollm2-135m-instruct"),
    data=dpo.PreferenceDataConfig(path="unused", max_len=B.MAX_LEN),
    algo=dpo.PreferenceAlgoConfig(beta=B.BETA),
    optim=OptimConfig(lr=B.LR, weight_decay=0.0, warmup_steps=0, schedule="linear", max_grad_norm=1.0),
    train=TrainConfig(
        output_dir=out + "/lm",
        max_steps=100,
        batch_size=8,
        micro_batch_size=8,
        threads=1,
        device="cpu",
        dtype="fp32",
        gradient_checkpointing="off",
    ),
)
run = start_run(lcfg, "bench", model, seq_len=2 * B.MAX_LEN, console=B.Quiet())
reference = dpo.make_reference(model, "sigmoid")
state = build_state(run, model, tok, BatchOrder(len(data), 8, 0), 100)
L = {}
real = pair_forward.pair_logits


def wrapped(m, pack):
    key = "ref" if m is reference else "policy"
    t = time.perf_counter()
    r = real(m, pack)
    L[key] = L.get(key, 0) + time.perf_counter() - t
    return r


dpo.pair_logits = wrapped  # times the policy's and the reference's packed forwards
for rep, idx in enumerate(batches):
    pack = pair_forward.pack_pairs([data.pairs[i] for i in list(idx)])
    if rep == 0:
        print(
            "lmforge rows",
            [len(x) for x in pack.input_ids],
            "tokens",
            sum(len(x) for x in pack.input_ids),
            "predicted",
            len(pack.targets),
        )
    L.clear()
    t = time.perf_counter()
    ref = dpo.reference_logps(state, reference, pack)
    tr = time.perf_counter() - t
    t = time.perf_counter()
    loss, _ = dpo.micro_loss(state, lcfg.algo, pack, ref, 8)
    tl = time.perf_counter() - t
    t = time.perf_counter()
    state.updater.precision.backward(loss)
    tb = time.perf_counter() - t
    t = time.perf_counter()
    state.updater.step(rep + 1)
    to = time.perf_counter() - t
    print(
        f"lmforge pairs {rep}: policy fwd {L['policy']:.2f} ref fwd {L['ref']:.2f} (reference_logps {tr:.2f}) "
        f"micro_loss {tl:.2f} backward {tb:.2f} clip+adamw {to:.2f} total {tr + tl + tb + to:.2f}",
        flush=True,
    )
