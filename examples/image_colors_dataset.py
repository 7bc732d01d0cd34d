"""An image dataset file in llama-cookbook's contract, drawn offline: "What color is the shape?" about a shape in one
of six colours on a white 28 x 28 image.

    leantune finetune --model_name DIR --dataset custom_dataset \
        --custom_dataset.file examples/image_colors_dataset.py --batching_strategy padding

``get_custom_dataset(dataset_config, processor, split)`` returns rows as the cookbook's OCR-VQA file does (``images``,
and ``texts`` of user and assistant turns); ``get_data_collator(processor)`` renders each with the processor's chat
template, processes text and image together and keeps the loss on the answer alone. Nothing is downloaded: the
images are drawn with PIL from a seed per split, so every run sees the same rows. ``get_blank_dataset`` is the
control: the same questions and answers with every image blank, so the answer cannot be seen.
"""

import random

from PIL import Image, ImageDraw

COLORS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220), "yellow": (235, 210, 20),
          "purple": (130, 40, 170), "orange": (245, 130, 20)}
SIZE = 28
QUESTION = "What color is the shape?"
ROWS = {"train": 360, "validation": 60, "test": 60}  # the cookbook's vision recipe names its held-out split test


def draw(color, rng: random.Random) -> Image.Image:
    """A filled circle, square or triangle of ``color`` (None: a blank image) at a random place and size."""
    image = Image.new("RGB", (SIZE, SIZE), "white")
    if color is None:
        return image
    size = rng.randint(10, 20)
    left, top = rng.randint(0, SIZE - size), rng.randint(0, SIZE - size)
    box = [left, top, left + size, top + size]
    pen = ImageDraw.Draw(image)
    shape = rng.choice(("circle", "square", "triangle"))
    if shape == "circle":
        pen.ellipse(box, fill=color)
    elif shape == "square":
        pen.rectangle(box, fill=color)
    else:
        pen.polygon([(left, top + size), (left + size // 2, top), (left + size, top + size)], fill=color)
    return image


def rows(split: str, blank: bool = False) -> list[dict]:
    rng = random.Random(f"image-colors-{split}")
    names = list(COLORS)
    made = []
    for index in range(ROWS.get(split, ROWS["validation"])):
        name = names[index % len(names)]  # every colour equally often
        made.append({"images": [draw(None if blank else COLORS[name], rng)],
                     "texts": [{"user": QUESTION, "assistant": name}]})
    rng.shuffle(made)
    return made


def get_custom_dataset(dataset_config, processor, split):
    return rows(split)


def get_blank_dataset(dataset_config, processor, split):
    return rows(split, blank=True)


def conversation(row: dict, with_answer: bool = True) -> list[dict]:
    turn = row["texts"][0]
    dialog = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": turn["user"]}]}]
    if with_answer:
        dialog.append({"role": "assistant", "content": [{"type": "text", "text": turn["assistant"]}]})
    return dialog


class ColorsCollator:
    """Rows to a padded batch: the chat template's text with the image, labels on the answer and its end only."""

    def __init__(self, processor):
        self.processor = processor
        self.processor.tokenizer.padding_side = "right"

    def __call__(self, samples):
        images = [[row["images"][0].convert("RGB")] for row in samples]
        texts = [self.processor.apply_chat_template(conversation(row)) for row in samples]
        prompts = [self.processor.apply_chat_template(conversation(row, with_answer=False), add_generation_prompt=True)
                   for row in samples]
        # the chat template renders the special tokens itself: the processor adds none again
        batch = self.processor(images=images, text=texts, padding=True, return_tensors="pt", add_special_tokens=False)
        labels = batch["input_ids"].clone()
        for row, (prompt, image) in enumerate(zip(prompts, images)):
            prompt_tokens = len(self.processor(images=[image], text=[prompt], return_tensors="pt",
                                               add_special_tokens=False)["input_ids"][0])
            labels[row, :prompt_tokens] = -100
        labels[batch["attention_mask"] == 0] = -100
        batch["labels"] = labels
        return batch


def get_data_collator(processor):
    return ColorsCollator(processor)
