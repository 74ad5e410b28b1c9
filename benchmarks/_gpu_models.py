"""The three models of the GPU throughput table (``gpu_throughput.py``), full size or toy.

* ``resnet50``: ResNet-50's shape (bottleneck blocks [3, 4, 6, 3], widths 64-512 times
  4, BatchNorm after every convolution; 25.6M parameters), built here from ``torch.nn``
  (the GPU image has no torchvision), on random 224x224 images, 1000 classes;
* ``gpt2``: transformers' ``GPT2LMHeadModel`` at GPT-2 small's size (12 layers, d=768,
  12 heads, vocab 50257, 1024 positions, tied head; 124M parameters), random init,
  SDPA attention, dropout off (as in pretraining recipes such as nanoGPT's);
* ``llama``: transformers' ``LlamaForCausalLM`` with Llama-2-7B's blocks (d_model 4,096,
  32 heads, MLP 11,008, RMSNorm, rotary positions) at sequence length 2,048: two blocks
  and a vocabulary of 8,192 (the blocks' matmuls are the fp8 range torchao is measured
  on; the small vocabulary keeps ten copies of the model, one per mode, in an H100's
  memory at once).

Every model takes one batch and returns a loss through :func:`loss_of`: a cross entropy
on fp32 logits (as native autocast computes it), so the loss path is the same in every
mode. ``toy=True`` gives the same classes at sizes a CPU trains in milliseconds (the
rehearsal of ``gpu_checks.sh``): widths that stay multiples of 16 (fp8's shapes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

MODELS = ("resnet50", "gpt2", "llama")


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (the stride), 1x1 expand by 4, each followed by BatchNorm."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        return F.relu(self.bn3(self.conv3(y)) + self.downsample(x))


class ResNet50(nn.Module):
    """Stem (7x7 convolution, BatchNorm, max pool), four stages of bottlenecks, global
    average pool, classifier."""

    def __init__(self, widths: tuple[int, ...] = (64, 128, 256, 512),
                 blocks: tuple[int, ...] = (3, 4, 6, 3), classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 7, 2, 3, bias=False),
                                  nn.BatchNorm2d(widths[0]), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        layers: list[nn.Module] = []
        cin = widths[0]
        for stage, (width, count) in enumerate(zip(widths, blocks, strict=True)):
            for i in range(count):
                layers.append(Bottleneck(cin, width, 2 if stage > 0 and i == 0 else 1))
                cin = width * Bottleneck.expansion
        self.stages = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)
        for module in self.modules():  # He initialisation, as torchvision's ResNets
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def _gpt2(toy: bool) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    sizes = (dict(n_layer=1, n_embd=64, n_head=2, vocab_size=512, n_positions=64) if toy
             else dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024))
    last = sizes["vocab_size"] - 1  # GPT-2's end-of-text token is its last id
    config = GPT2Config(**sizes, bos_token_id=last, eos_token_id=last, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    config._attn_implementation = "sdpa"
    return GPT2LMHeadModel(config)


def _llama(toy: bool) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = (dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=4, num_hidden_layers=1, vocab_size=256,
                  max_position_embeddings=64) if toy
             else dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                       num_key_value_heads=32, num_hidden_layers=2, vocab_size=8192,
                       max_position_embeddings=2048))
    config = LlamaConfig(**sizes, use_cache=False, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


@dataclasses.dataclass(frozen=True)
class Workload:
    """One model of the table: how to build it and a batch, and what a step counts."""

    name: str
    unit: str  # what the throughput counts: "images" or "tokens"
    items: int  # per step
    shape: str  # the batch, in words
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[torch.device, torch.Generator], tuple[torch.Tensor, torch.Tensor]]

    def forward(self, model: Callable[..., object], inputs: torch.Tensor) -> torch.Tensor:
        """The model's output tensor (the logits of the language models)."""
        out = model(inputs) if self.unit == "images" else model(input_ids=inputs)
        return out if isinstance(out, torch.Tensor) else out.logits  # type: ignore[attr-defined]


def loss_of(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy on fp32 logits: native autocast's loss precision, in every mode."""
    return F.cross_entropy(out.float().flatten(0, -2), targets.flatten())


def workload(name: str, toy: bool = False) -> Workload:
    """The workload called ``name`` (one of :data:`MODELS`), full size or toy."""
    if name == "resnet50":
        batch, size, classes = (4, 32, 16) if toy else (64, 224, 1000)
        kwargs = dict(widths=(8, 16), blocks=(1, 1), classes=classes) if toy else {}

        def images(device: torch.device, gen: torch.Generator
                   ) -> tuple[torch.Tensor, torch.Tensor]:
            x = torch.randn(batch, 3, size, size, device=device, generator=gen)
            return x, torch.randint(0, classes, (batch,), device=device, generator=gen)

        return Workload(name, "images", batch, f"{batch} x 3 x {size} x {size}",
                        lambda: ResNet50(**kwargs), images)  # type: ignore[arg-type]
    if name in ("gpt2", "llama"):
        vocab, batch, seq = {("gpt2", True): (512, 2, 32), ("gpt2", False): (50257, 8, 1024),
                             ("llama", True): (256, 2, 32),
                             ("llama", False): (8192, 1, 2048)}[name, toy]

        def tokens(device: torch.device, gen: torch.Generator
                   ) -> tuple[torch.Tensor, torch.Tensor]:
            ids = torch.randint(0, vocab, (batch, seq + 1), device=device, generator=gen)
            return ids[:, :-1], ids[:, 1:]

        make = _gpt2 if name == "gpt2" else _llama
        return Workload(name, "tokens", batch * seq, f"{batch} x {seq} tokens",
                        lambda: make(toy), tokens)
    raise ValueError(f"unknown model {name!r}; accepted: {', '.join(MODELS)}")


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks compiled one by one (regional compilation): the
    transformers' decoder layers. Empty for the CNN, which is compiled whole."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return [m for m in model.modules() if isinstance(m, GPT2Block | LlamaDecoderLayer)]
