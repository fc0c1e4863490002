"""The model zoo's architectures and training shapes: real ``transformers`` models built
from local configs (no hub), and the ways real scripts train them.

Imported by ``bench/zoo/train.py`` (in the training processes) and ``bench/zoo/__main__``
(the runner, for the case list). Each case is a ``torch.nn.ModuleDict`` of several
architectures trained together — their losses summed — so one job covers several models
and one process start is paid per case, not per model. What a case sets:

* ``models``: the architectures (GPT-2 tied, Llama untied and tied, Qwen2 tied, Mixtral
  with routed experts, BERT masked LM, T5 with its embedding shared by encoder, decoder
  and head);
* ``optim``: the optimizers and parameter groups (AdamW/Adam, fused/foreach, betas, eps,
  weight decay and lr per group, two optimizers, frozen parameters, state loaded at a
  step above 1,000) and schedulers (LambdaLR warm-up, OneCycleLR, a hand-set lr);
* ``precision``: fp32, bf16 autocast, fp16 autocast with a GradScaler, bf16 parameters;
* ``compile``: torch.compile around each model's forward.

Sizes: ``tiny`` (CPU, CI: a few thousand parameters a model) and ``large`` (the H200:
100 M – 1 B parameters in all, the embeddings spanning several of Leto's chunks).

Not covered: models with BatchNorm statistics (their own test against DDP:
``tests/test_buffers_integ.py``), sequence lengths and batch sizes users train at (the
zoo checks exactness, not speed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

ARCHS = ("gpt2", "llama", "llama-tied", "qwen2", "mixtral", "bert", "t5")


@dataclass(frozen=True)
class Size:
    vocab: int
    hidden: int
    layers: int
    heads: int
    seq: int
    batch: int


SIZES = {
    "tiny": Size(vocab=256, hidden=32, layers=2, heads=4, seq=16, batch=2),
    # ~1 B parameters in the "tied" case; embeddings of 50 K x 2 K span several 128 MiB
    # chunks, as in the job that raised the false alarm.
    "large": Size(vocab=50304, hidden=2048, layers=4, heads=16, seq=256, batch=4),
}


def build(arch: str, s: Size) -> torch.nn.Module:
    """One architecture at size ``s``, from a local config (eager attention: the
    deterministic kernels on every device)."""
    import transformers as tf

    common = dict(vocab_size=s.vocab, attn_implementation="eager")
    llama = dict(
        hidden_size=s.hidden, intermediate_size=2 * s.hidden, num_hidden_layers=s.layers,
        num_attention_heads=s.heads, num_key_value_heads=max(1, s.heads // 2),
        max_position_embeddings=s.seq,
    )  # fmt: skip
    if arch == "gpt2":
        cfg = tf.GPT2Config(
            n_positions=s.seq, n_embd=s.hidden, n_layer=s.layers, n_head=s.heads,
            bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            **common,
        )  # fmt: skip
        return tf.GPT2LMHeadModel(cfg)
    if arch in ("llama", "llama-tied"):
        cfg = tf.LlamaConfig(tie_word_embeddings=arch == "llama-tied", **llama, **common)
        return tf.LlamaForCausalLM(cfg)
    if arch == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(tie_word_embeddings=True, **llama, **common))
    if arch == "mixtral":
        cfg = tf.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **llama, **common)
        return tf.MixtralForCausalLM(cfg)
    if arch == "bert":
        cfg = tf.BertConfig(
            hidden_size=s.hidden, num_hidden_layers=s.layers, num_attention_heads=s.heads,
            intermediate_size=2 * s.hidden, max_position_embeddings=s.seq,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **common,
        )  # fmt: skip
        return tf.BertForMaskedLM(cfg)
    if arch == "t5":
        cfg = tf.T5Config(
            d_model=s.hidden, d_kv=s.hidden // s.heads, d_ff=2 * s.hidden, num_layers=s.layers,
            num_heads=s.heads, dropout_rate=0.0, decoder_start_token_id=0, **common,
        )  # fmt: skip
        return tf.T5ForConditionalGeneration(cfg)
    raise ValueError(f"unknown architecture {arch!r}; the zoo has {', '.join(ARCHS)}")


def loss_of(arch: str, model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The architecture's training loss on ``tokens`` (batch x seq)."""
    if arch == "bert":  # masked LM: every 4th position masked (token 1), the rest ignored
        labels = torch.full_like(tokens, -100)
        labels[:, ::4] = tokens[:, ::4]
        x = tokens.clone()
        x[:, ::4] = 1
        return model(input_ids=x, labels=labels).loss
    if arch == "t5":  # encoder reads the first half, the decoder predicts the second
        half = tokens.shape[1] // 2
        return model(
            input_ids=tokens[:, :half].contiguous(), labels=tokens[:, half:].contiguous()
        ).loss
    return model(input_ids=tokens, labels=tokens).loss


_ZIPF: dict[int, torch.Tensor] = {}


def tokens(seed: int, rank: int, it: int, micro: int, s: Size) -> torch.Tensor:
    """A micro-batch of ``rank`` in iteration ``it``: a function of its position only (the
    same on a recovered trainer). Zipf-distributed, as text is: most of a large vocabulary
    is absent from a batch, so a tied embedding's rows of those tokens get only the output
    head's tiny gradients (float32 denormals in the optimizer state — what uniform tokens
    never exercise, and where the fused pass once parted from torch)."""
    if s.vocab not in _ZIPF:
        _ZIPF[s.vocab] = 1.0 / torch.arange(1, s.vocab - 1, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed + 1_000_003 * it + 1_009 * rank + micro)
    drawn = torch.multinomial(_ZIPF[s.vocab], s.batch * s.seq, replacement=True, generator=g)
    return (drawn + 2).view(s.batch, s.seq)


@dataclass(frozen=True)
class Case:
    name: str
    models: tuple[str, ...]
    optim: str  # see make_optimizers
    precision: str = "fp32"  # "bf16-autocast" | "fp16-scaler" | "bf16-params"
    compile: bool = False
    frozen: tuple[str, ...] = field(default=())  # parameter-name prefixes not trained
    clip: float | None = 1.0
    what: str = ""  # the training shapes it covers, for the table
    refused: str = ""  # Leto refuses it before the first iteration: part of the message
    cuda_only: bool = False  # (torch.compile: Inductor's CPU build takes minutes in CI)


CASES = {
    c.name: c
    for c in (
        Case(
            "tied",
            ("gpt2", "llama-tied", "qwen2", "t5"),
            "adamw-fused-2groups",
            precision="bf16-autocast",
            what="tied and 3-way shared embeddings; fused AdamW, 2 groups, LambdaLR warm-up, "
            "bf16 autocast, clipping",
        ),
        Case(
            "groups",
            ("llama", "mixtral", "bert"),
            "adamw-foreach-3groups-loaded",
            frozen=("models.bert.bert.embeddings.",),
            what="untied Llama, routed experts, masked LM; foreach AdamW, 3 groups "
            "(betas, eps, wd, lr), OneCycleLR, frozen embeddings, state loaded at step "
            "1234",
        ),
        Case(
            "two-optimizers",
            ("gpt2", "llama"),
            "adam+adamw-handset",
            clip=0.5,
            what="Adam (fused) and AdamW (fused) side by side, a hand-set lr, clipping 0.5",
        ),
        Case(
            "fp16",
            ("gpt2", "llama-tied"),
            "adamw-fused-2groups",
            precision="fp16-scaler",
            what="fp16 autocast with a GradScaler (unscale, clip, step)",
        ),
        Case(
            "bf16-params",
            ("llama", "qwen2"),
            "adamw-fused-2groups",
            precision="bf16-params",
            clip=None,
            what="bf16 parameters, fused AdamW",
            refused="under leto.Run parameters are float32",
        ),
        Case(
            "compile",
            ("gpt2",),
            "adamw-fused-2groups",
            compile=True,
            cuda_only=True,
            what="torch.compile of the model's forward",
        ),
    )  # fmt: skip
}


class Zoo(torch.nn.Module):
    """A case's models side by side; the forward returns the sum of their losses."""

    def __init__(self, case: Case, size: str):
        super().__init__()
        self.archs = {a.replace("-", "_"): a for a in case.models}
        self.models = torch.nn.ModuleDict({k: build(a, SIZES[size]) for k, a in self.archs.items()})
        self.compiled: dict | None = None  # torch.compile'd forwards (not submodules)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fwd = self.compiled or self.models
        return sum(loss_of(a, fwd[k], x) for k, a in self.archs.items())


def make_model(case: Case, size: str, device: torch.device) -> Zoo:
    """The case's models on ``device``, frozen prefixes not trained. Seeded: every rank
    and both launchers build the same weights."""
    torch.manual_seed(0)
    model = Zoo(case, size)
    if case.precision == "bf16-params":
        model.to(torch.bfloat16)
    model.to(device)
    for n, p in model.named_parameters():
        if n.startswith(case.frozen):
            p.requires_grad_(False)
    if case.compile:
        model.compiled = {k: torch.compile(m) for k, m in model.models.items()}
    return model


def make_optimizers(case: Case, model: torch.nn.Module, iterations: int):
    """(optimizers, schedulers, hand_set_lr(it) or None) as the case's script makes them."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in named if p.ndim >= 2]
    no_decay = [p for n, p in named if p.ndim < 2]
    if case.optim == "adamw-fused-2groups":
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
            lr=3e-3, betas=(0.9, 0.95), fused=True,
        )  # fmt: skip
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / 3))
        return [opt], [sched], None
    if case.optim == "adamw-foreach-3groups-loaded":
        experts = [p for n, p in named if ".experts." in n]
        rest2 = [p for n, p in named if p.ndim >= 2 and ".experts." not in n]
        opt = torch.optim.AdamW(
            [
                {"params": rest2, "weight_decay": 0.1},
                {"params": experts, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.01,
                 "lr": 1e-3},
                {"params": no_decay, "weight_decay": 0.0, "eps": 1e-5},
            ],
            lr=2e-3, betas=(0.9, 0.95), foreach=True,
        )  # fmt: skip
        _load_state(opt, step=1234)
        sched = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=[2e-3, 1e-3, 2e-3], total_steps=iterations + 1
        )
        return [opt], [sched], None
    if case.optim == "adam+adamw-handset":
        first = [p for n, p in named if n.startswith("models.gpt2.")]
        second = [p for n, p in named if not n.startswith("models.gpt2.")]
        a = torch.optim.Adam(first, lr=1e-3, betas=(0.9, 0.99), fused=True)
        b = torch.optim.AdamW(second, lr=1e-3, weight_decay=0.05, fused=True)
        return [a, b], [], lambda it: 1e-3 * (0.5 + 0.5 * (it % 3) / 2)
    raise ValueError(f"unknown optimizer set-up {case.optim!r}")


def _load_state(opt: torch.optim.Optimizer, step: int) -> None:
    """Optimizer state as a script's checkpoint leaves it after ``step`` steps (moments
    drawn from a fixed generator), loaded as a resuming script loads it."""
    g = torch.Generator().manual_seed(step)
    sd = opt.state_dict()
    i = 0
    for group in opt.param_groups:
        for p in group["params"]:
            m = (torch.randn(p.shape, generator=g) * 1e-3).to(p.dtype)
            v = (torch.rand(p.shape, generator=g) * 1e-6).to(p.dtype)
            sd["state"][i] = {"step": torch.tensor(float(step)), "exp_avg": m, "exp_avg_sq": v}
            i += 1
    opt.load_state_dict(sd)
