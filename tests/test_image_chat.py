"""Chat records with images (``--dataset chat_dataset`` on an image-and-text model): image parts by path or from
an ``images`` column, rendered by the processor's chat template, the loss on the assistant's tokens alone, and a
missing or unreadable image said naming its record before any weight loads."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from leantune.flags import parse_run_config
from leantune.data.image_chat import ImageChatCollator, image_chat_rows
from leantune.formats.records import DatasetError


def _record(kind: str, image: str, answer: str) -> dict:
    question = [{"type": "text", "text": "What color?"}]
    if kind == "path":
        return {"messages": [{"role": "user", "content": [{"type": "image", "image": image}, *question]},
                             {"role": "assistant", "content": answer}]}
    if kind == "column":
        return {"images": [image], "messages": [{"role": "user", "content": [{"type": "image"}, *question]},
                                                {"role": "assistant", "content": [{"type": "text", "text": answer}]}]}
    return {"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": answer}]}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("image_chat")
    (folder / "img").mkdir()
    records = []
    for index in range(12):
        answer = ("red", "blue", "green")[index % 3]
        Image.new("RGB", (28, 20), answer).save(folder / "img" / f"{index}.png")
        records.append(_record(("path", "column", "text")[index % 3], f"img/{index}.png", answer))
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder, records


@pytest.mark.parametrize("family", ["mllama", "llava", "gemma3"])
def test_the_labels_are_the_assistants_tokens_alone(tiny_vision, data, family):
    from transformers import AutoProcessor

    folder, records = data
    processor = AutoProcessor.from_pretrained(tiny_vision(family))
    rows = image_chat_rows([dict(r, _line=i + 1) for i, r in enumerate(records[:3])], "train.jsonl", folder)
    assert [len(row["images"]) for row in rows] == [1, 1, 0]
    batch = ImageChatCollator(processor)(rows)
    eos = processor.tokenizer.eos_token
    for row, answer in enumerate(("red", "blue", "green")):
        labels = batch["labels"][row]
        assert processor.tokenizer.decode(labels[labels != -100]) == answer + eos
        kept = labels != -100
        assert (batch["input_ids"][row][kept] == labels[kept]).all()
    assert "pixel_values" in batch


def test_chat_records_with_images_train_through_leantune_finetune(tiny_vision, data, tmp_path):
    from leantune.finetuning import run

    folder, _ = data
    lines = []
    run(parse_run_config(["--model_name", str(tiny_vision("llava")), "--dataset", "chat_dataset", "--data_path",
                          str(folder / "train.jsonl"), "--batching_strategy", "padding", "--output_dir",
                          str(tmp_path / "out"), "--max_train_step", "2", "--batch_size_training", "4",
                          "--context_length", "64", "--num_workers_dataloader", "0", "--val_fraction", "0.25"]),
        log=lines.append)
    assert any(line.startswith(f"data: {folder / 'train.jsonl'}: 9 train / 3 validation rows, 3 batches of 4 per "
                               "epoch, each made by the processor's chat template") for line in lines)
    assert sum(line.startswith("epoch 1 step") for line in lines) == 2


def _deep(path):
    Image.fromarray(np.full((8, 8), 4000, dtype=np.uint16)).save(path)


@pytest.mark.parametrize("record, prepare, message", [
    (_record("path", "img/none.png", "red"), None, "train.jsonl:1: image {folder}/img/none.png: no such file"),
    (_record("path", "bad.png", "red"), lambda f: (f / "bad.png").write_text("not a png"),
     "train.jsonl:1: image {folder}/bad.png: not a readable image"),
    (_record("path", "deep.png", "red"), lambda f: _deep(f / "deep.png"),
     "train.jsonl:1: image {folder}/deep.png is I;16 \\(more than 8 bits a pixel\\)"),
    ({**_record("column", "a.png", "red"), "images": ["a.png", "a.png"]}, None,
     "train.jsonl:1: 1 image\\(s\\) of its 'images' column have no image part to go in"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}, {"role": "assistant", "content": "x"}]}, None,
     "train.jsonl:1: turn 0: an image part names no image"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "video"}]},
                   {"role": "assistant", "content": "x"}]}, None,
     "train.jsonl:1: turn 0: a content part must be"),
])
def test_a_bad_image_record_is_said_naming_it_before_any_weight_loads(tiny_vision, tmp_path, record, prepare, message):
    from leantune.finetuning import run

    if prepare is not None:
        prepare(tmp_path)
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    (tmp_path / "train.jsonl").write_text(json.dumps(record) + "\n")
    flags = ["--model_name", str(tiny_vision("llava")), "--dataset", "chat_dataset", "--data_path",
             str(tmp_path / "train.jsonl"), "--batching_strategy", "padding", "--output_dir", str(tmp_path / "out"),
             "--context_length", "64", "--val_fraction", "0"]
    with pytest.raises(DatasetError, match=message.format(folder=tmp_path)):
        run(parse_run_config(flags), log=lambda line: None)


def test_every_image_is_checked_as_the_records_are_read(tmp_path):
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    records = [dict(_record("path", "a.png", "red"), _line=line) for line in (1, 2, 3)]
    records.append(dict(_record("path", "gone.png", "red"), _line=4))
    with pytest.raises(DatasetError, match=f"train.jsonl:4: image {tmp_path}/gone.png: no such file"):
        image_chat_rows(records, "train.jsonl", tmp_path)


def test_packing_image_chat_records_is_refused(tiny_vision, data, tmp_path):
    from leantune.finetuning import run

    folder, _ = data
    flags = ["--model_name", str(tiny_vision("llava")), "--dataset", "chat_dataset", "--data_path",
             str(folder / "train.jsonl"), "--output_dir", str(tmp_path / "out"), "--context_length", "64"]
    with pytest.raises(DatasetError, match="--batching_strategy packing: .*train.jsonl's rows are batched with their "
                                           "images by the processor and cannot be packed"):
        run(parse_run_config(flags), log=lambda line: None)


def test_text_only_chat_records_on_an_image_and_text_model_train_as_text_rows(tiny_vision, tmp_path):
    from leantune.finetuning import run

    records = [_record("text", "", "hi") for _ in range(6)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    lines = []
    run(parse_run_config(["--model_name", str(tiny_vision("llava")), "--dataset", "chat_dataset", "--data_path",
                          str(tmp_path / "train.jsonl"), "--output_dir", str(tmp_path / "out"), "--max_train_step",
                          "1", "--context_length", "64", "--val_fraction", "0"]), log=lines.append)
    assert any(line.startswith("data: chat_dataset from") and "(packing, examples apart)" in line for line in lines)


def test_a_record_without_an_image_is_refused_when_only_the_vision_side_trains(tiny_vision, data, tmp_path):
    from leantune.finetuning import run

    folder, _ = data
    flags = ["--model_name", str(tiny_vision("llava")), "--dataset", "chat_dataset", "--data_path",
             str(folder / "train.jsonl"), "--batching_strategy", "padding", "--output_dir", str(tmp_path / "out"),
             "--context_length", "64", "--freeze_LLM_only"]
    with pytest.raises(DatasetError, match="train.jsonl:3: holds no image, and every row must \\(only the vision "
                                           "side trains"):
        run(parse_run_config(flags), log=lambda line: None)


def _two_turns(first: str, second: str, third: str = "") -> dict:
    question = [{"type": "image", "path": "img/0.png"}, {"type": "text", "text": "What"},
                {"type": "text", "text": " color?"}]
    turns = [{"role": "system", "content": "Look closely."}, {"role": "user", "content": question},
             {"role": "assistant", "content": first},
             {"role": "user", "content": [{"type": "text", "text": "And this one?"}, {"type": "image"}]},
             {"role": "assistant", "content": [{"type": "text", "text": second}]}]
    if third:
        turns += [{"role": "user", "content": "Sure?"}, {"role": "assistant", "content": third}]
    return {"messages": turns, "images": ["img/1.png"], "_line": 7}


@pytest.mark.parametrize("last_only, answers", [(False, ["red", "blue", "yes"]), (True, ["yes"])])
def test_each_assistant_turn_of_a_conversation_with_two_images_is_labelled(tiny_vision, data, last_only, answers):
    from transformers import AutoProcessor

    folder, _ = data
    processor = AutoProcessor.from_pretrained(tiny_vision("mllama"))
    rows = image_chat_rows([_two_turns("red", "blue", "yes")], "chat.jsonl", folder)
    assert [image.name for image in rows[0]["images"]] == ["0.png", "1.png"]
    batch = ImageChatCollator(processor, last_only=last_only)(rows)
    eos, labels, ids = processor.tokenizer.eos_token, batch["labels"][0], batch["input_ids"][0]
    spans, start = [], None
    for index, label in enumerate(labels.tolist() + [-100]):
        if label != -100 and start is None:
            start = index
        elif label == -100 and start is not None:
            spans.append(processor.tokenizer.decode(ids[start:index]))
            start = None
    assert spans == [answer + eos for answer in answers]
    assert batch["pixel_values"].shape[1] == 2  # both images, in the row's order
    assert processor.tokenizer.decode(ids).endswith("yes" + eos)  # the whole conversation, no generation prompt


def test_images_from_a_datasets_column_are_read_as_pictures_or_bytes(tiny_vision, tmp_path):
    import io

    from transformers import AutoProcessor

    red, blue = Image.new("RGB", (28, 28), "red"), io.BytesIO()
    Image.new("RGB", (28, 28), "blue").save(blue, format="PNG")
    records = [{**_record("column", "", "red"), "images": [red], "_line": 1},
               {**_record("column", "", "blue"), "images": [{"bytes": blue.getvalue(), "path": None}], "_line": 2}]
    rows = image_chat_rows(records, "hub", tmp_path)
    batch = ImageChatCollator(AutoProcessor.from_pretrained(tiny_vision("llava")))(rows)
    assert batch["pixel_values"].shape[0] == 2
    assert not torch.equal(batch["pixel_values"][0], batch["pixel_values"][1])


@pytest.mark.parametrize("record, message", [
    ({"messages": ["hi", {"role": "assistant", "content": "x"}], "images": []},
     "turn 0 needs a 'role' and a 'content'"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text"}]},
                   {"role": "assistant", "content": "x"}]}, "turn 0: a text part needs a string 'text'"),
    ({"messages": [{"role": "assistant", "content": [{"type": "image", "image": "a.png"}]},
                   {"role": "user", "content": "x"}]}, "turn 0 is 'assistant' where 'user' was due"),
])
def test_a_malformed_conversation_is_said_naming_its_record(tmp_path, record, message):
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    with pytest.raises(DatasetError, match=f"chat.jsonl:4: {message}"):
        image_chat_rows([dict(record, _line=4)], "chat.jsonl", tmp_path)


def test_a_chat_template_given_with_the_flag_renders_the_conversations(tiny_vision, data):
    from transformers import AutoProcessor

    folder, records = data
    template = ("{% for m in messages %}### {{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}"
                "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}"
                "{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
                "{% if add_generation_prompt %}### assistant: {% endif %}")
    processor = AutoProcessor.from_pretrained(tiny_vision("llava"))
    rows = image_chat_rows([dict(records[0], _line=1)], "train.jsonl", folder)
    batch = ImageChatCollator(processor, template=template)(rows)
    text = processor.tokenizer.decode(batch["input_ids"][0])
    assert text.startswith("### user: <image>") and "### assistant: red" in text
    labels = batch["labels"][0]
    assert processor.tokenizer.decode(labels[labels != -100]).strip() == "red"


def test_holds_images_finds_image_parts_and_an_images_column():
    from leantune.data.image_chat import holds_images

    assert holds_images([_record("text", "", "a"), _record("path", "x.png", "b")])
    assert holds_images([{"images": ["x.png"], "messages": [{"role": "user", "content": "no part"}]}])
    assert not holds_images([_record("text", "", "a"), {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x"}]}]}, {"messages": ["not a turn"]}])


@pytest.mark.parametrize("image, message", [
    (7, "an image must be a path, a PIL image or a datasets Image; got int"),
    ({"bytes": b"not a png", "path": None}, "image its image: not a readable image"),
])
def test_an_images_column_entry_that_is_no_image_is_said(tmp_path, image, message):
    with pytest.raises(DatasetError, match=f"hub:2: {message}"):
        image_chat_rows([{**_record("column", "", "red"), "images": [image], "_line": 2}], "hub", tmp_path)


def test_a_template_that_adds_to_the_last_turn_is_refused(tiny_vision, data):
    from transformers import AutoProcessor

    folder, _ = data
    ending = ("{% for m in messages %}<{{ m['role'] }}>{% if m['content'] is string %}{{ m['content'] }}{% else %}"
              "{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}"
              "{% endfor %}{% endif %}\n{% endfor %}{% if not add_generation_prompt %}the end, truly{% endif %}"
              "{% if add_generation_prompt %}<assistant>{% endif %}")
    rows = image_chat_rows([dict(_two_turns("red", "blue"), _line=5)], "chat.jsonl", folder)
    with pytest.raises(DatasetError, match="chat.jsonl:5: the chat template renders the turns before assistant turn 2"):
        ImageChatCollator(AutoProcessor.from_pretrained(tiny_vision("llava")), template=ending)(rows)


def test_a_template_that_rewrites_earlier_turns_is_refused(tiny_vision, data):
    from transformers import AutoProcessor

    folder, _ = data
    rewriting = ("{% for m in messages %}{{ m['role'] }}{% if loop.last %}!{% endif %}: {% if m['content'] is string %}"
                 "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>{% else %}"
                 "{{ p['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}")
    rows = image_chat_rows([dict(_two_turns("red", "blue"), _line=3)], "chat.jsonl", folder)
    with pytest.raises(DatasetError, match="chat.jsonl:3: the chat template renders the turns before assistant turn"):
        ImageChatCollator(AutoProcessor.from_pretrained(tiny_vision("llava")), template=rewriting)(rows)
