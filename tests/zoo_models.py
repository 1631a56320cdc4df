"""The zoo's models: tiny random-init versions of the architectures people train today, each wrapped
so that ``forward(*inputs)`` returns the loss (tests/test_zoo.py).

Text models come from Hugging Face transformers' configs (no downloaded weights). Vision models are
written here, block for block after torchvision's (torchvision's wheels do not load with
torch 2.13.0+cpu: ``operator torchvision::nms does not exist``), at widths 8-32 on 16x16 images.
Dropout and stochastic depth are 0: N ranks can only equal PyTorch when the forward is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

VOCAB = 64
SEQ = 8
IMAGE = 16


@dataclass
class ZooModel:
    name: str
    make: object  # () -> nn.Module, seeded
    data: object  # (rows) -> dict of arrays keyed by forward()'s argument names, in order
    # Float tensors exported as initializers that PyTorch does not train and that the transpiler's
    # rules (transpiler/trainable.py) cannot tell from a parameter: frozen with --freeze, as a user would.
    freeze: str | None = None
    sync_bn: bool = False  # BatchNorm: N ranks equal one device (and PyTorch) only with --sync-bn
    transformers: bool = False  # built from a Hugging Face transformers config
    # Tensors the rules freeze that PyTorch trains (a 0-d parameter such as CLIP's logit_scale,
    # frozen as `scalar`): trained with --train, as a user would.
    train: str | None = None


def _tokens(rows: int, seed: int = 0, low: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(low, VOCAB, size=(rows, SEQ), dtype=np.int64)


def bert_data(rows: int) -> dict[str, np.ndarray]:
    # No padding token (0): BERT's word embedding has padding_idx=0, whose row PyTorch never
    # updates through the embedding; both exporters write a plain Gather, which loses that, so a
    # batch holding token 0 trains that row (docs/models.md).
    return {"input_ids": _tokens(rows, low=1)}


def _images(rows: int, classes: int = 4, channels: int = 3, size: int = IMAGE) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((rows, channels, size, size), dtype=np.float32),
            "labels": rng.integers(0, classes, size=rows, dtype=np.int64)}


# ---------------------------------------------------------------------------------------------
# Text: transformers


class _CausalLM(nn.Module):
    """Loss of next-token prediction on the input itself (transformers shifts the labels)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=input_ids).loss


class _Seq2SeqLM(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss


def make_gpt2(attention: str = "eager") -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation=attention)
    return _CausalLM(GPT2LMHeadModel(config))


def make_gpt2_sdpa() -> nn.Module:
    """GPT-2 with torch's scaled_dot_product_attention: dynamo writes opset 23's Attention op."""
    return make_gpt2("sdpa")


def make_bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, attn_implementation="eager")
    return _CausalLM(BertForMaskedLM(config))  # labels = inputs: a masked-LM loss on every token


def make_llama(attention: str = "eager") -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                         attn_implementation=attention)
    return _CausalLM(LlamaForCausalLM(config))


def make_llama_sdpa() -> nn.Module:
    """Llama with SDPA attention and grouped-query heads: opset 23's Attention with kv_num_heads."""
    return make_llama("sdpa")


def make_t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                      relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0,
                      pad_token_id=0, attn_implementation="eager")
    return _Seq2SeqLM(T5ForConditionalGeneration(config))


def t5_data(rows: int) -> dict[str, np.ndarray]:
    return {"input_ids": _tokens(rows, 0), "labels": _tokens(rows, 1)}


def make_bart() -> nn.Module:
    """BART: encoder, decoder with causal self-attention and cross-attention over the encoder's
    output, embeddings shared by both and the head, learned positions, a final_logits_bias buffer."""
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    config = BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=16,
                        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, attn_implementation="eager")
    return _Seq2SeqLM(BartForConditionalGeneration(config))


def bart_data(rows: int) -> dict[str, np.ndarray]:
    # BART's embeddings have padding_idx=1 (pad_token_id): kept out of the data, as BERT's 0.
    return {"input_ids": _tokens(rows, 0, low=2), "labels": _tokens(rows, 1, low=2)}


class _WhisperClassifier(nn.Module):
    """Whisper's encoder (Conv1d + GELU stem, sinusoidal positions, pre-LN transformer) and a
    mean-pooled linear head with cross-entropy."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import WhisperConfig
        from transformers.models.whisper.modeling_whisper import WhisperEncoder

        config = WhisperConfig(num_mel_bins=8, d_model=32, encoder_layers=2, encoder_attention_heads=4,
                               encoder_ffn_dim=64, max_source_positions=8, dropout=0.0, attention_dropout=0.0,
                               activation_dropout=0.0, attn_implementation="eager")
        self.encoder = WhisperEncoder(config)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(x).last_hidden_state
        return F.cross_entropy(self.head(hidden.mean(dim=1)), labels)


def make_whisper() -> nn.Module:
    torch.manual_seed(0)
    return _WhisperClassifier()


def whisper_data(rows: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((rows, 8, 16), dtype=np.float32),
            "labels": rng.integers(0, 4, size=rows, dtype=np.int64)}


class _ImageClassification(nn.Module):
    """A transformers image classifier whose own loss (cross-entropy over ``labels``) is the output."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=x, labels=labels).loss


def make_swin() -> nn.Module:
    """Swin: 2x2 patches of a 16x16 image (8x8 tokens), windows of 4x4, the second block of stage 1
    shifted (``torch.roll`` and the shifted-window mask), relative position biases gathered from
    their table, patch merging to stage 2 (4x4 tokens: one unshifted window), mean-pooled head."""
    from transformers import SwinConfig, SwinForImageClassification

    torch.manual_seed(0)
    # Eager attention: with SDPA, dynamo's export fails on a view of SDPA's transposed output (torch 2.13).
    config = SwinConfig(image_size=IMAGE, patch_size=2, num_channels=3, embed_dim=16, depths=[2, 1],
                        num_heads=[2, 4], window_size=4, mlp_ratio=2.0, drop_path_rate=0.0, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, num_labels=4, attn_implementation="eager")
    model = SwinForImageClassification(config)
    with torch.no_grad():  # the original Swin's trunc_normal(std=0.02); transformers starts them at zeros
        for name, parameter in model.named_parameters():
            if name.endswith("relative_position_bias_table"):
                parameter.normal_(0.0, 0.02)
    return _ImageClassification(model)



def make_electra() -> nn.Module:
    """ELECTRA's discriminator (replaced-token detection): embeddings of their own width projected to
    the hidden width, a BERT encoder with a padding mask, and transformers' own loss, BCE-with-logits
    over the tokens the attention mask keeps (``logits[attention_mask == 1]``: boolean-mask indexing)."""
    from transformers import ElectraConfig, ElectraForPreTraining

    torch.manual_seed(0)
    config = ElectraConfig(vocab_size=VOCAB, embedding_size=16, hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=2, intermediate_size=64, max_position_embeddings=16,
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="eager")
    return _ElectraDiscriminator(ElectraForPreTraining(config))


class _ElectraDiscriminator(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss


def electra_data(rows: int) -> dict[str, np.ndarray]:
    # Two masked-out places per row, so every rank keeps as many tokens and the mean over a rank's
    # tokens averages to the global batch's (as masked_tokens_data). The token ids avoid the
    # padding token 0 (padding_idx, as BERT's); 0/1 labels mark the "replaced" tokens.
    rng = np.random.default_rng(0)
    mask = np.ones((rows, SEQ), dtype=np.int64)
    for row in mask:
        row[rng.choice(SEQ, size=2, replace=False)] = 0
    return {"input_ids": _tokens(rows, low=1), "attention_mask": mask,
            "labels": rng.integers(0, 2, size=(rows, SEQ), dtype=np.int64)}


CLIP_GROUP = 3  # image-text pairs contrasted with each other in one data row


class _CLIPGroups(nn.Module):
    """CLIP: a ViT image tower and a causal text tower pooled at each text's end token (an index
    gather), both projected, L2-normalized and compared by cosine logits scaled by the learned
    ``logit_scale.exp()``; the loss is CLIP's symmetric contrastive cross-entropy.

    transformers' own loss contrasts every image with every text of the batch
    (``arange(len(logits))`` labels): a loss over the whole batch, so N ranks would each contrast
    their own rows only. Here a data row holds a group of CLIP_GROUP pairs, contrasted with each
    other exactly as transformers' ``image_text_contrastive_loss`` does with a batch, and the loss is
    the mean over the groups: N ranks then compute what one device does. test_zoo.py checks that the
    model's own loss is refused at transpile time in one line."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        groups, size = input_ids.shape[0], input_ids.shape[1]
        out = self.model(input_ids=input_ids.flatten(0, 1), pixel_values=pixel_values.flatten(0, 1))
        text = out.text_embeds.reshape(groups, size, -1)  # normalized, as for transformers' logits
        image = out.image_embeds.reshape(groups, size, -1)
        logits = torch.matmul(text, image.transpose(1, 2)) * self.model.logit_scale.exp()  # [G, K, K] per text
        labels = torch.arange(size).expand(groups, size).reshape(-1)
        caption = F.cross_entropy(logits.reshape(groups * size, size), labels)
        image_loss = F.cross_entropy(logits.transpose(1, 2).reshape(groups * size, size), labels)
        return (caption + image_loss) / 2.0


class _CLIPOwnLoss(nn.Module):
    """CLIPModel(return_loss=True): transformers' contrastive loss over the whole batch."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, pixel_values=pixel_values, return_loss=True).loss


def _clip_model() -> nn.Module:
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(0)
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                max_position_embeddings=SEQ, eos_token_id=VOCAB - 1, pad_token_id=1, bos_token_id=0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=IMAGE,
                  patch_size=4, num_channels=3)
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=16, attn_implementation="eager")
    return CLIPModel(config)


def make_clip() -> nn.Module:
    return _CLIPGroups(_clip_model())


def make_clip_own_loss() -> nn.Module:
    return _CLIPOwnLoss(_clip_model())


def _clip_texts(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    # Tokens 2..VOCAB-2; each text ends at its end token (VOCAB - 1) somewhere in its second half,
    # padding (1) after it: the text tower pools the hidden state at the first end token.
    texts = rng.integers(2, VOCAB - 1, size=(*shape, SEQ), dtype=np.int64)
    flat = texts.reshape(-1, SEQ)
    for row, end in zip(flat, rng.integers(SEQ // 2, SEQ, size=len(flat))):
        row[end] = VOCAB - 1
        row[end + 1:] = 1
    return texts


def clip_data(rows: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"pixel_values": rng.standard_normal((rows, CLIP_GROUP, 3, IMAGE, IMAGE), dtype=np.float32),
            "input_ids": _clip_texts((rows, CLIP_GROUP), rng)}


def clip_own_loss_data(rows: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"pixel_values": rng.standard_normal((rows, 3, IMAGE, IMAGE), dtype=np.float32),
            "input_ids": _clip_texts((rows,), rng)}


def make_whisper_seq2seq() -> nn.Module:
    """The full Whisper: the encoder (Conv1d stem, sinusoidal positions that PyTorch does not train)
    and a decoder with learned positions, causal self-attention and cross-attention over the
    encoder's output, its head tied to the decoder's token embedding; transformers' own loss, the
    labels shifted right behind the decoder start token."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    config = WhisperConfig(vocab_size=VOCAB, num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                           decoder_ffn_dim=64, max_source_positions=8, max_target_positions=16, pad_token_id=1,
                           bos_token_id=0, eos_token_id=0, decoder_start_token_id=0, dropout=0.0,
                           attention_dropout=0.0, activation_dropout=0.0, attn_implementation="eager")
    return _Whisper(WhisperForConditionalGeneration(config))


class _Whisper(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_features=input_features, labels=labels).loss


def whisper_seq2seq_data(rows: int) -> dict[str, np.ndarray]:
    # The decoder's token embedding has padding_idx=1 (pad_token_id): kept out of the labels.
    rng = np.random.default_rng(0)
    return {"input_features": rng.standard_normal((rows, 8, 16), dtype=np.float32),
            "labels": _tokens(rows, 1, low=2)}


# ---------------------------------------------------------------------------------------------
# Vision: written after torchvision's blocks


class _Classifier(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.body(x), labels)


def _conv_bn(cin: int, cout: int, k: int, stride: int = 1, groups: int = 1, act: type | None = nn.ReLU):
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, k, stride, (k - 1) // 2, groups=groups, bias=False),
                               nn.BatchNorm2d(cout)]
    if act is not None:
        layers.append(act())
    return nn.Sequential(*layers)


class _SqueezeExcite(nn.Module):
    def __init__(self, channels: int, squeezed: int, act: type, gate: type) -> None:
        super().__init__()
        self.fc1 = nn.Conv2d(channels, squeezed, 1)
        self.fc2 = nn.Conv2d(squeezed, channels, 1)
        self.act, self.gate = act(), gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = F.adaptive_avg_pool2d(x, 1)
        return x * self.gate(self.fc2(self.act(self.fc1(scale))))


class _InvertedResidual(nn.Module):
    """MobileNetV3's / EfficientNet's MBConv: expand 1x1, depthwise kxk, squeeze-excite, project 1x1."""

    def __init__(self, cin: int, expanded: int, cout: int, k: int, stride: int, act: type, se: tuple | None):
        super().__init__()
        layers: list[nn.Module] = []
        if expanded != cin:
            layers.append(_conv_bn(cin, expanded, 1, act=act))
        layers.append(_conv_bn(expanded, expanded, k, stride, groups=expanded, act=act))
        if se is not None:
            layers.append(_SqueezeExcite(expanded, max(4, expanded // 4), *se))
        layers.append(_conv_bn(expanded, cout, 1, act=None))
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        return x + y if self.residual else y


def make_mobilenet_v3() -> nn.Module:
    """MobileNetV3-small's layout: HardSwish stem, blocks with ReLU/HardSwish and an SE gated by
    HardSigmoid, a HardSwish classifier head."""
    torch.manual_seed(0)
    body = nn.Sequential(
        _conv_bn(3, 8, 3, 2, act=nn.Hardswish),
        _InvertedResidual(8, 8, 8, 3, 1, nn.ReLU, (nn.ReLU, nn.Hardsigmoid)),
        _InvertedResidual(8, 24, 16, 3, 2, nn.ReLU, None),
        _InvertedResidual(16, 32, 16, 5, 1, nn.Hardswish, (nn.ReLU, nn.Hardsigmoid)),
        _conv_bn(16, 32, 1, act=nn.Hardswish),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(32, 32), nn.Hardswish(), nn.Linear(32, 4),
    )
    return _Classifier(body)


class _MobileNetV2Block(nn.Module):
    """torchvision's MobileNetV2 InvertedResidual: expand 1x1 + ReLU6 (unless the ratio is 1),
    depthwise 3x3 + ReLU6, linear 1x1 projection; a residual when the shape is kept."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        layers: list[nn.Module] = [] if expand == 1 else [_conv_bn(cin, hidden, 1, act=nn.ReLU6)]
        layers += [_conv_bn(hidden, hidden, 3, stride, groups=hidden, act=nn.ReLU6), _conv_bn(hidden, cout, 1, act=None)]
        self.conv = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.residual else self.conv(x)


def make_mobilenet_v2() -> nn.Module:
    """MobileNetV2's layout with torchvision's initialization (convs kaiming-normal fan-out,
    BatchNorm weight 1 bias 0, the head normal(0, 0.01)): ReLU6 (Clip(0, 6)) after BatchNorm,
    where a channel that is constant over the batch (e.g. all zeros after the ReLU6 before it)
    normalizes to exactly 0, a bound of the Clip."""
    torch.manual_seed(0)
    features = nn.Sequential(
        _conv_bn(3, 16, 3, 2, act=nn.ReLU6),
        _MobileNetV2Block(16, 8, 1, 1),
        _MobileNetV2Block(8, 12, 2, 6),
        _MobileNetV2Block(12, 12, 1, 6),
        _MobileNetV2Block(12, 16, 2, 6),
        _conv_bn(16, 64, 1, act=nn.ReLU6),
    )
    body = nn.Sequential(features, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 4))
    for m in body.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0, 0.01)
            nn.init.zeros_(m.bias)
    return _Classifier(body)


def make_efficientnet() -> nn.Module:
    """EfficientNet-B0's layout: SiLU stem, MBConv blocks with SiLU and a Sigmoid-gated SE."""
    torch.manual_seed(0)
    se = (nn.SiLU, nn.Sigmoid)
    body = nn.Sequential(
        _conv_bn(3, 8, 3, 2, act=nn.SiLU),
        _InvertedResidual(8, 8, 8, 3, 1, nn.SiLU, se),
        _InvertedResidual(8, 32, 16, 3, 2, nn.SiLU, se),
        _InvertedResidual(16, 64, 16, 5, 1, nn.SiLU, se),
        _conv_bn(16, 32, 1, act=nn.SiLU),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 4),
    )
    return _Classifier(body)


class _LayerNorm2d(nn.LayerNorm):
    """LayerNorm over channels of an NCHW tensor (torchvision's ConvNeXt downsampling)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class _ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.layer_scale = nn.Parameter(torch.full((dim, 1, 1), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.dwconv(x).permute(0, 2, 3, 1))
        y = self.fc2(F.gelu(self.fc1(y))).permute(0, 3, 1, 2)
        return x + self.layer_scale * y


def make_convnext() -> nn.Module:
    torch.manual_seed(0)
    body = nn.Sequential(
        nn.Conv2d(3, 16, 4, 4), _LayerNorm2d(16, eps=1e-6),
        _ConvNeXtBlock(16),
        _LayerNorm2d(16, eps=1e-6), nn.Conv2d(16, 32, 2, 2),
        _ConvNeXtBlock(32),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.LayerNorm(32, eps=1e-6), nn.Linear(32, 4),
    )
    return _Classifier(body)


class _ViT(nn.Module):
    """torchvision's VisionTransformer: conv patch embedding, class token, learned positions,
    pre-LN encoder blocks (nn.MultiheadAttention, GELU MLP), head on the class token."""

    def __init__(self, patch: int = 4, dim: int = 32, depth: int = 2, heads: int = 4, classes: int = 4) -> None:
        super().__init__()
        tokens = (IMAGE // patch) ** 2 + 1
        self.patch = nn.Conv2d(3, dim, patch, patch)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, tokens, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        x = self.norm(self.encoder(x))
        return F.cross_entropy(self.head(x[:, 0]), labels)


def make_vit() -> nn.Module:
    torch.manual_seed(0)
    return _ViT()


class _ResBlock(nn.Module):
    """Diffusion UNets' residual block: GroupNorm, SiLU, conv, twice; a 1x1 skip when widths differ."""

    def __init__(self, cin: int, cout: int, groups: int = 4) -> None:
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(groups, cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2, self.conv2 = nn.GroupNorm(groups, cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return self.skip(x) + h


class _UNet(nn.Module):
    """Two levels: down by a strided conv, up by nearest-neighbour Resize, skip by concatenation;
    the loss is the mean squared error against a target image (a denoiser's objective)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.down_block = _ResBlock(width, width)
        self.down = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1)
        self.mid = _ResBlock(2 * width, 2 * width)
        self.up_block = _ResBlock(3 * width, width)
        self.out_norm = nn.GroupNorm(4, width)
        self.out = nn.Conv2d(width, 3, 3, padding=1)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        skip = self.down_block(self.stem(x))
        h = self.mid(self.down(skip))
        h = F.interpolate(h, scale_factor=2.0, mode="nearest")
        h = self.up_block(torch.cat([h, skip], dim=1))
        return F.mse_loss(self.out(F.silu(self.out_norm(h))), target)


def make_unet() -> nn.Module:
    torch.manual_seed(0)
    return _UNet()


def unet_data(rows: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    shape = (rows, 3, IMAGE, IMAGE)
    return {"x": rng.standard_normal(shape, dtype=np.float32), "target": rng.standard_normal(shape, dtype=np.float32)}


class _RMSNormLM(nn.Module):
    """torch.nn.RMSNorm in a small language model: dynamo writes RMSNormalization from opset 23."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.norm1, self.fc, self.norm2 = nn.RMSNorm(width), nn.Linear(width, width), nn.RMSNorm(width, eps=1e-6)
        self.head = nn.Linear(width, VOCAB)
        with torch.no_grad():  # scales away from their all-ones start, so a wrong scale gradient shows
            self.norm1.weight.uniform_(0.5, 1.5)
            self.norm2.weight.uniform_(0.5, 1.5)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.norm1(self.embed(input_ids))
        h = self.norm2(h + F.silu(self.fc(h)))
        logits = self.head(h)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), input_ids[:, 1:].reshape(-1))


def make_rmsnorm_lm() -> nn.Module:
    torch.manual_seed(0)
    return _RMSNormLM()



# ---------------------------------------------------------------------------------------------
# Ops of the second wave (issue 28): the rest of the activation set, PixelShuffle, boolean-mask
# indexing, a weight-normalized convolution


class _ActivationMLP(nn.Module):
    """One Linear per activation, side by side (each with its own path to the head, so a wrong
    gradient shows in its Linear's update): ELU, SELU, CELU, PReLU (per-feature slopes), Softplus,
    Softsign, Mish, Hardshrink, Softshrink. The exporters write Elu, Selu, Celu, PRelu, Softplus and
    (dynamo) Mish, the others as their decompositions."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        acts = [nn.ELU(0.7), nn.SELU(), nn.CELU(0.8), nn.PReLU(width), nn.Softplus(), nn.Softsign(), nn.Mish(),
                nn.Hardshrink(0.3), nn.Softshrink(0.2)]
        self.fcs = nn.ModuleList(nn.Linear(8, width) for _ in acts)
        self.acts = nn.ModuleList(acts)
        self.head = nn.Linear(width * len(acts), 4)
        with torch.no_grad():  # slopes away from their 0.25 fill, so a wrong slope gradient shows
            self.acts[3].weight.uniform_(0.1, 0.4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = torch.cat([act(fc(x)) for fc, act in zip(self.fcs, self.acts)], dim=-1)
        return F.cross_entropy(self.head(h), labels)


def make_activations_mlp() -> nn.Module:
    torch.manual_seed(0)
    return _ActivationMLP()


def activations_data(rows: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((rows, 8), dtype=np.float32), "labels": rng.integers(0, 4, size=rows)}


class _PixelShuffleCNN(nn.Module):
    """Super-resolution's sub-pixel upsampling (PixelShuffle: DepthToSpace, CRD mode) and its inverse
    (PixelUnshuffle: a Reshape/Transpose chain from both exporters)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.shuffle = nn.PixelShuffle(2)  # (B, 16, 16, 16) -> (B, 4, 32, 32)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.unshuffle = nn.PixelUnshuffle(8)  # -> (B, 256, 4, 4)
        self.head = nn.Linear(256, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.unshuffle(self.conv2(F.relu(self.shuffle(self.conv1(x)))))
        return F.cross_entropy(self.head(h.mean(dim=(2, 3))), labels)


def make_pixel_shuffle() -> nn.Module:
    torch.manual_seed(0)
    return _PixelShuffleCNN()


class _MaskedTokens(nn.Module):
    """Boolean-mask indexing, ``h[mask]`` over the non-padding tokens (NonZero -> Transpose -> GatherND
    from both exporters), regressed onto ``target[mask]``. dynamo cannot export cross_entropy over a
    data-dependent number of rows (it guards on it), hence the squared error."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.fc = nn.Linear(width, width)

    def forward(self, input_ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        mask = input_ids != 0
        h = torch.tanh(self.embed(input_ids))
        return ((self.fc(h[mask]) - target[mask]) ** 2).mean()


def make_masked_tokens() -> nn.Module:
    torch.manual_seed(0)
    return _MaskedTokens()


def masked_tokens_data(rows: int) -> dict[str, np.ndarray]:
    # Two padding tokens (0) per row at random places: every rank selects as many tokens, so the
    # mean over a rank's selection averages to the mean over the global batch's.
    rng = np.random.default_rng(0)
    tokens = _tokens(rows, low=1)
    for row in tokens:
        row[rng.choice(SEQ, size=2, replace=False)] = 0
    return {"input_ids": tokens, "target": rng.standard_normal((rows, SEQ, 16), dtype=np.float32)}


class _WeightNormConv(nn.Module):
    """wav2vec2's positional convolution: a grouped Conv1d under ``weight_norm(dim=2)`` (the norm over
    the other axes, ReduceL2 from both exporters), GELU, a residual; logsumexp pooling over time
    (ReduceLogSumExp) and a linear head."""

    def __init__(self, channels: int = 16) -> None:
        super().__init__()
        conv = nn.Conv1d(channels, channels, 5, padding=2, groups=4)
        self.conv = nn.utils.parametrizations.weight_norm(conv, name="weight", dim=2)
        self.head = nn.Linear(channels, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = x + F.gelu(self.conv(x))
        return F.cross_entropy(self.head(torch.logsumexp(h, dim=-1)), labels)


def make_weight_norm_conv() -> nn.Module:
    torch.manual_seed(0)
    return _WeightNormConv()


def weight_norm_data(rows: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((rows, 16, 12), dtype=np.float32), "labels": rng.integers(0, 4, size=rows)}

# ---------------------------------------------------------------------------------------------
# Recurrent networks (issue 28): the exporters write one LSTM/GRU node per layer and direction set


class _LSTMLanguageModel(nn.Module):
    """A 2-layer LSTM language model whose head shares the embedding matrix (weight tying): the
    embedding's gradient sums the lookup's and the head's."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.lstm = nn.LSTM(width, width, num_layers=2, batch_first=True)
        self.head = nn.Linear(width, VOCAB)
        self.head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.embed(input_ids))
        logits = self.head(hidden[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), input_ids[:, 1:].reshape(-1))


def make_lstm_lm() -> nn.Module:
    torch.manual_seed(0)
    return _LSTMLanguageModel()


class _GRUClassifier(nn.Module):
    """A 2-layer bidirectional GRU (PyTorch's linear_before_reset=1) over a sequence of feature
    vectors, classified from both directions' final states of the last layer (dynamo then leaves
    that layer's Y output off) and the mean of the first layer's outputs."""

    def __init__(self, features: int = 8, width: int = 12) -> None:
        super().__init__()
        self.first = nn.GRU(features, width, batch_first=True, bidirectional=True)
        self.second = nn.GRU(2 * width, width, batch_first=True, bidirectional=True)
        self.head = nn.Linear(4 * width, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        y, _ = self.first(x)
        _, h = self.second(y)
        features = torch.cat([h[0], h[1], y.mean(dim=1)[:, : 2 * h.shape[-1]]], dim=-1)
        return F.cross_entropy(self.head(features), labels)


def make_gru_classifier() -> nn.Module:
    torch.manual_seed(0)
    return _GRUClassifier()


def sequence_data(rows: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((rows, SEQ, 8), dtype=np.float32), "labels": rng.integers(0, 4, size=rows)}


ZOO: dict[str, ZooModel] = {m.name: m for m in [
    ZooModel("gpt2", make_gpt2, lambda rows: {"input_ids": _tokens(rows)}, transformers=True),
    ZooModel("gpt2_sdpa", make_gpt2_sdpa, lambda rows: {"input_ids": _tokens(rows)}, transformers=True),
    ZooModel("bert", make_bert, bert_data, transformers=True),
    ZooModel("llama", make_llama, lambda rows: {"input_ids": _tokens(rows)}, transformers=True),
    ZooModel("llama_sdpa", make_llama_sdpa, lambda rows: {"input_ids": _tokens(rows)}, transformers=True),
    ZooModel("t5", make_t5, t5_data, transformers=True),
    ZooModel("bart", make_bart, bart_data, transformers=True),
    ZooModel("whisper_encoder", make_whisper, whisper_data, freeze=r"embed_positions", transformers=True),
    ZooModel("mobilenet_v3", make_mobilenet_v3, _images, sync_bn=True),
    ZooModel("efficientnet", make_efficientnet, _images, sync_bn=True),
    ZooModel("convnext", make_convnext, _images),
    ZooModel("vit", make_vit, _images),
    ZooModel("unet", make_unet, unet_data),
    ZooModel("rmsnorm_lm", make_rmsnorm_lm, lambda rows: {"input_ids": _tokens(rows)}),
    ZooModel("activations_mlp", make_activations_mlp, activations_data),
    ZooModel("pixel_shuffle", make_pixel_shuffle, _images),
    ZooModel("masked_tokens", make_masked_tokens, masked_tokens_data),
    ZooModel("weight_norm_conv", make_weight_norm_conv, weight_norm_data),
    ZooModel("mobilenet_v2", make_mobilenet_v2, _images, sync_bn=True),
    ZooModel("lstm_lm", make_lstm_lm, lambda rows: {"input_ids": _tokens(rows)}),
    ZooModel("gru_classifier", make_gru_classifier, sequence_data),
    ZooModel("swin", make_swin, _images, transformers=True),
    ZooModel("electra", make_electra, electra_data, transformers=True),
    ZooModel("clip", make_clip, clip_data, train=r"logit_scale", transformers=True),
    ZooModel("whisper", make_whisper_seq2seq, whisper_seq2seq_data, freeze=r"encoder\.embed_positions",
             transformers=True),
]}
