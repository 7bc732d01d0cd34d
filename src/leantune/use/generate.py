"""``leantune generate --model_name DIR_OR_RUN [--prompt TEXT | --chat]``: try a model, streaming its tokens.

``--model_name`` is a model directory or hub name (a full fine-tune's output, a merged model), or
a LoRA run's output directory: its adapter is put on its base (the adapter's own, or
``--base_model``). ``--chat`` wraps each prompt in the tokenizer's chat template as a user turn
(without ``--prompt`` it reads one turn a line from standard input, keeping the conversation);
without it the prompt is continued as it is. The sampling flags are named as in transformers'
``generate``; greedy unless ``--do_sample``.

``--image PATH`` asks an image-and-text model (Llama 3.2 Vision, LLaVA, Qwen2-VL, Gemma 3; a trained run, its
adapter, or a merged one) about an image: with ``--chat`` the image goes in the first user turn, rendered by the
processor's chat template; without it the prompt should hold the processor's image token (it is put in front
when it does not).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

import torch

from leantune.models.merging import ADAPTER_CONFIG, DTYPE_CHOICES
from leantune.model_structure import image_text_base, model_class, unwrap_model


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="leantune generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model_name", required=True, help="a model directory or hub name, or a LoRA run's output_dir")
    p.add_argument("--base_model", help="a LoRA run's base, where not the one its adapter names")
    p.add_argument("--prompt", help="the text to continue (with --chat: the user's turn)")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template to each turn")
    p.add_argument("--image", help="an image file for an image-and-text model (PNG, JPEG, ...)")
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--do_sample", action="store_true", help="sample instead of greedy decoding")
    # unset, the model's own generation_config.json decides
    p.add_argument("--temperature", type=float)
    p.add_argument("--top_p", type=float)
    p.add_argument("--top_k", type=int)
    p.add_argument("--repetition_penalty", type=float)
    p.add_argument("--seed", type=int, default=0, help="for --do_sample")
    p.add_argument("--dtype", choices=sorted(DTYPE_CHOICES),
                   help="default: bfloat16 on a GPU that has it, else float32")
    return p


def load(model_name: str, base_model: str | None, dtype: torch.dtype, device: torch.device, images: bool = False):
    """The model (a LoRA run's base with its adapter on it) and the tokenizer (``images``: the processor), ready to
    generate."""
    from transformers import AutoConfig, AutoProcessor, AutoTokenizer

    path = Path(model_name)
    # not a hub id (one "owner/name"), or its first part is a local folder: a path, missing; no hub retries for it
    if not path.exists() and (model_name.startswith((".", "/", "~")) or model_name.count("/") != 1
                              or Path(model_name.split("/")[0]).is_dir()):
        raise OSError(f"--model_name {model_name}: no such directory (a model directory, a LoRA run's output_dir or a "
                      "hub name)")
    if (path / ADAPTER_CONFIG).is_file():
        from peft import PeftModel

        base = base_model or json.loads((path / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
        auto_class = model_class(AutoConfig.from_pretrained(base))
        model = PeftModel.from_pretrained(auto_class.from_pretrained(base, dtype=dtype), str(path))
    else:
        model = model_class(AutoConfig.from_pretrained(model_name)).from_pretrained(model_name, dtype=dtype)
    if images and image_text_base(model) is None:
        raise ValueError(f"--image: {model_name} is a language model alone ({type(unwrap_model(model)).__name__}); "
                         "drop --image, or give an image-and-text model")
    reader = AutoProcessor if images else AutoTokenizer
    return model.to(device).eval(), reader.from_pretrained(model_name)


def generate(model, tokenizer, text: str, args: argparse.Namespace, out, image=None) -> str:
    """Stream the continuation of ``text`` (about ``image``: ``tokenizer`` is then the processor) to ``out``;
    returns it."""
    from transformers import TextStreamer

    if image is None:
        inputs = tokenizer(text, return_tensors="pt", add_special_tokens=not args.chat).to(model.device)
    else:
        inputs = tokenizer(images=[[image]], text=[text], return_tensors="pt", add_special_tokens=not args.chat)
        inputs = inputs.to(model.device, dtype=model.dtype)  # floating inputs (the pixels) in the model's dtype
        tokenizer = tokenizer.tokenizer
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    streamer.on_finalized_text = lambda piece, stream_end=False: print(piece, end="" if not stream_end else "\n",
                                                                       file=out, flush=True)
    given = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                 repetition_penalty=args.repetition_penalty)
    options = {name: value for name, value in given.items() if value is not None}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    torch.manual_seed(args.seed)
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
                                streamer=streamer, pad_token_id=pad, **options)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def run(args: argparse.Namespace, lines=None, out=None) -> None:
    """Load, then generate for ``--prompt`` or each turn read from ``lines`` (standard input), printing to ``out``."""
    lines, out = lines if lines is not None else sys.stdin, out if out is not None else sys.stdout
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = DTYPE_CHOICES[args.dtype] if args.dtype else (
        torch.bfloat16 if cuda and torch.cuda.is_bf16_supported() else torch.float32)
    model, tokenizer = load(args.model_name, args.base_model, dtype, device, images=args.image is not None)
    image = read_image(args.image) if args.image else None
    if not args.chat:
        prompt = args.prompt
        marker = getattr(tokenizer, "image_token", None) if image is not None else None
        if marker and marker not in prompt:
            prompt = marker + prompt
        generate(model, tokenizer, prompt, args, out, image)
        return
    if tokenizer.chat_template is None:  # checked once the tokenizer is read (a run's may differ from its base's)
        raise ValueError(f"--chat: {args.model_name}'s tokenizer has no chat template; drop --chat to continue "
                         "the prompt as text")
    turns = [args.prompt] if args.prompt is not None else (line.rstrip("\n") for line in lines)
    messages: list[dict] = []
    for turn in turns:
        if not turn:
            break
        if image is not None:  # the image in the first turn, as parts the processor's template renders
            content = [{"type": "image"}] * (not messages) + [{"type": "text", "text": turn}]
            messages.append({"role": "user", "content": content})
        else:
            messages.append({"role": "user", "content": turn})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        answer = generate(model, tokenizer, text, args, out, image)
        messages.append({"role": "assistant",
                         "content": answer if image is None else [{"type": "text", "text": answer}]})


def read_image(path: str):
    """The image at ``path`` in RGB (``OSError`` naming it when it is missing or not an image)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (FileNotFoundError, UnidentifiedImageError) as err:
        raise OSError(f"--image {path}: "
                      f"{'no such file' if isinstance(err, FileNotFoundError) else 'not an image'}") from None


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if (args.prompt is None and not args.chat) or args.prompt == "":
        print("leantune: error: give --prompt TEXT (not empty), or --chat to type turns", file=sys.stderr)
        return 2
    try:
        run(args)
    except (OSError, ValueError, RuntimeError) as err:  # a missing model or run, a mismatched base: one line
        lines = str(err).strip().splitlines()
        print(f"leantune: error: {lines[0] if lines else type(err).__name__}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # leaving the --chat loop
        return 0
    return 0
