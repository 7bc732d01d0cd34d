"""--dataset chat_dataset: chat records in the tokenizer's template, the loss on the assistant's turns only."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from leantune import finetuning
from leantune.config import DataConfig
from leantune.data import build_datasets
from leantune.formats.chat import conversation, encode_chat, encode_chats
from leantune.formats.records import DatasetError
from leantune.labels import IGNORE_INDEX

# Meta's Llama 3 layout (headers, the content trimmed, <|eot_id|>) and ChatML (Qwen's: content as it is,
# <|im_end|> then a newline the assistant does not write).
LLAMA3 = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
          "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TEMPLATES = {"llama3": (LLAMA3, "<|eot_id|>", str.strip), "chatml": (CHATML, "<|im_end|>", lambda text: text)}

CHAT = {"messages": [{"role": "system", "content": "You answer briefly."},
                     {"role": "user", "content": "Reverse the word cat."},
                     {"role": "assistant", "content": " tac\n"},
                     {"role": "user", "content": "And dog?"},
                     {"role": "assistant", "content": "god, which is dog reversed."}], "_line": 3}


def _with_template(tokenizer, name):
    template, end_of_turn, _ = TEMPLATES[name]
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>",
                                                                "<|eot_id|>", "<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = template
    return tokenizer


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("last_only", [False, True], ids=["every-turn", "last-turn"])
def test_the_labelled_tokens_are_the_assistant_contents_and_end_of_turn(tokenizer, name, last_only):
    _, end_of_turn, shown = TEMPLATES[name]
    tokenizer = _with_template(tokenizer, name)
    example = encode_chat(conversation(CHAT, "chat.jsonl:3"), tokenizer, "chat.jsonl:3", last_only=last_only)
    answers = [t["content"] for t in CHAT["messages"] if t["role"] == "assistant"]
    expected = [tokenizer(shown(a) + end_of_turn, add_special_tokens=False)["input_ids"]
                for a in (answers[-1:] if last_only else answers)]
    labelled = [t for t in example["labels"] if t != IGNORE_INDEX]
    assert labelled == [t for ids in expected for t in ids]
    assert tokenizer.decode(labelled) == "".join(shown(a) + end_of_turn
                                                 for a in (answers[-1:] if last_only else answers))
    # the prompt is tokenized as at inference: on its own, ending with the generation prompt
    prompt = tokenizer.apply_chat_template(CHAT["messages"][:2], tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert example["input_ids"][:len(prompt_ids)] == prompt_ids
    assert all(t == IGNORE_INDEX for t in example["labels"][:len(prompt_ids)])


def test_sharegpt_conversations_read_as_messages():
    shared = {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"},
                                {"from": "gpt", "value": "a"}]}
    assert conversation(shared, "x") == [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                                         {"role": "assistant", "content": "a"}]


BAD = {
    "no assistant turn": ({"messages": [{"role": "user", "content": "q"}]}, "chat.jsonl:5: no assistant turn"),
    "roles out of order": ({"messages": [{"role": "user", "content": "q"}, {"role": "user", "content": "q"}]},
                           "chat.jsonl:5: turn 1 is 'user' where 'assistant' was due"),
    "a late system prompt": ({"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "s"}]},
                             "chat.jsonl:5: turn 1 is 'system' where 'assistant' was due"),
    "unanswered question": ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                                          {"role": "user", "content": "q"}]},
                            "chat.jsonl:5: ends with a user turn that has no answer"),
    "no turns": ({"prompt": "q"}, "chat.jsonl:5: expected 'messages'"),
    "a turn without content": ({"messages": [{"role": "user"}]},
                               "chat.jsonl:5: turn 0 needs a 'role' and a string 'content'"),
    "an unknown role": ({"conversations": [{"from": "bot", "value": "a"}]},
                        "chat.jsonl:5: turn 0 has role 'bot'; use system, user or assistant (ShareGPT"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_conversations_are_named_by_file_and_line(tokenizer, case):
    record, message = BAD[case]
    with pytest.raises(DatasetError, match=message.replace("(", r"\(")):
        encode_chats([{**record, "_line": 5}], tokenizer, "chat.jsonl")


def test_a_tokenizer_without_a_template_is_refused_naming_the_flag(tokenizer):
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(DatasetError, match="has no chat template; pass one with --chat_template"):
        encode_chats([CHAT], bare, "chat.jsonl")
    assert encode_chats([CHAT], bare, "chat.jsonl", template=CHATML)  # the flag's template is used


def test_a_chat_run_trains_on_the_bundled_chats_and_on_a_file(tiny_model_dir, tmp_path, capsys, tokenizer):
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(CHAT) + "\n" for _ in range(20)))
    for extra in ([], ["--data_path", str(data), "--assistant_turns", "last"]):
        out = tmp_path / f"out{len(extra)}"
        code = finetuning.main(["--model_name", str(tiny_model_dir), "--dataset", "chat_dataset", *extra, "--use_peft",
                                "--output_dir", str(out), "--context_length", "128", "--max_train_step", "3",
                                "--num_epochs", "1", "--num_workers_dataloader", "0", "--save_metrics"])
        assert code == 0, capsys.readouterr().err
        assert len(json.loads((out / "metrics.json").read_text())["train_steps"]) == 3
    train, _ = build_datasets(DataConfig(dataset="chat_dataset"), tokenizer, seed=0)
    first = [t for t in train[0]["labels"] if t != IGNORE_INDEX]
    assert tokenizer.decode(first).endswith(tokenizer.eos_token) and "<assistant>" not in tokenizer.decode(first)


def test_a_templates_own_refusal_names_the_record(tokenizer):
    refusing = ("{% for message in messages %}{% if message['role'] == 'system' %}"
                "{{ raise_exception('System role not supported') }}{% endif %}{{ message['content'] }}{% endfor %}")
    with pytest.raises(DatasetError, match="chat.jsonl:3: the chat template refused this conversation: System role"):
        encode_chats([CHAT], tokenizer, "chat.jsonl", template=refusing)


def test_an_empty_answer_adds_no_token_the_template_does_not_render(tokenizer):
    plain = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
             "{% if add_generation_prompt %}assistant: {% endif %}")
    chat = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""},
                         {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a"}], "_line": 1}
    example = encode_chats([chat], tokenizer, "chat.jsonl", template=plain)[0]
    rendered = tokenizer.apply_chat_template(chat["messages"], tokenize=False, chat_template=plain)
    assert tokenizer.decode(example["input_ids"]) == rendered
    # the empty answer trains nothing; the prompt's trailing space rides on the next answer's first token
    assert tokenizer.decode([t for t in example["labels"] if t != IGNORE_INDEX]) == " a"


def test_a_template_that_renders_no_assistant_token_is_refused_by_record(tokenizer):
    users_only = ("{% for message in messages %}{% if message['role'] == 'user' %}{{ message['content'] }}\n"
                  "{% endif %}{% endfor %}")
    with pytest.raises(DatasetError, match="chat.jsonl:3: the chat template leaves the assistant no token to learn"):
        encode_chats([CHAT], tokenizer, "chat.jsonl", template=users_only)


# Qwen3's habit: an assistant turn's reasoning (up to </think>) is dropped once a later turn follows it
STRIPS_EARLIER_REASONING = (
    "{% for message in messages %}{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and not loop.last %}{% set content = content.split('</think>')[-1] %}"
    "{% endif %}{{ '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_a_template_that_rewrites_earlier_turns_once_a_later_one_follows_is_refused(tokenizer):
    """Labelled from the prefixes, the first answer's reasoning would be absent from the row and the labels
    would land on other tokens (a user turn's among them): refused, with the fix. The last turn alone is exact."""
    chat = {"messages": [{"role": "user", "content": "Reverse cat."},
                         {"role": "assistant", "content": "<think>c-a-t backwards</think>tac"},
                         {"role": "user", "content": "And dog?"},
                         {"role": "assistant", "content": "god"}], "_line": 7}
    tokenizer = _with_template(tokenizer, "chatml")
    with pytest.raises(DatasetError, match="chat.jsonl:7: the chat template renders the turns before assistant turn 1 "
                                           "differently once it follows.*--chat_template"):
        encode_chats([chat], tokenizer, "chat.jsonl", template=STRIPS_EARLIER_REASONING)
    last = encode_chat(conversation(chat, "chat.jsonl:7"), tokenizer, "chat.jsonl:7", STRIPS_EARLIER_REASONING,
                       last_only=True)
    assert tokenizer.decode([t for t in last["labels"] if t != IGNORE_INDEX]).startswith("god")


def test_the_tokenization_cache_keeps_chat_templates_and_turns_apart(tokenizer, tmp_path, monkeypatch):
    """The format's own flags are in the cache's key: another --chat_template or --assistant_turns tokenizes again."""
    monkeypatch.setenv("LEANTUNE_HOME", str(tmp_path / "home"))  # an empty cache
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(CHAT) + "\n")
    tokenizer = _with_template(tokenizer, "llama3")
    runs = {"tokenizer's": DataConfig(dataset="chat_dataset", data_path=str(path), val_fraction=0),
            "chatml": DataConfig(dataset="chat_dataset", data_path=str(path), val_fraction=0, chat_template=CHATML),
            "last turn": DataConfig(dataset="chat_dataset", data_path=str(path), val_fraction=0,
                                    assistant_turns="last")}
    examples = {name: build_datasets(config, tokenizer, seed=0)[0][0] for name, config in runs.items()}
    uncached = {name: build_datasets(dataclasses.replace(config, dataset_cache=False), tokenizer, seed=0)[0][0]
                for name, config in runs.items()}
    assert examples == uncached and len({json.dumps(example) for example in examples.values()}) == 3
    # a template file edited in place: its text is in the key, not only its path
    template = tmp_path / "template.jinja"
    template.write_text(CHATML)
    from_file = DataConfig(dataset="chat_dataset", data_path=str(path), val_fraction=0, chat_template=str(template))
    assert build_datasets(from_file, tokenizer, seed=0)[0][0] == examples["chatml"]
    template.write_text(LLAMA3)
    assert build_datasets(from_file, tokenizer, seed=0)[0][0] == examples["tokenizer's"]
