"""The tokenizer is loaded once, by the first scheduler rank, and the server and
the detokenizer use a pickled copy (runtime/tokenizer_share.py): the copy must
behave as the tokenizer loaded from disk, and the detokenizer must stay free of
torch (what the sharing saves)."""

from __future__ import annotations

import pickle
import subprocess
import sys

from transformers import AutoTokenizer

TEXTS = ["Hello world", "  two leading spaces", "émoji 🤖 ünïcödé", "<|im_start|>user\nhi<|im_end|>", ""]


def test_the_pickled_copy_behaves_as_the_loaded_tokenizer(tiny_llama_dir):
    loaded = AutoTokenizer.from_pretrained(tiny_llama_dir)
    shared = pickle.loads(pickle.dumps(AutoTokenizer.from_pretrained(tiny_llama_dir)))
    assert type(shared) is type(loaded)
    for text in TEXTS:
        for special in (True, False):
            assert shared.encode(text, add_special_tokens=special) == loaded.encode(text, add_special_tokens=special)
    ids = list(range(len(loaded)))
    assert shared.convert_ids_to_tokens(ids) == loaded.convert_ids_to_tokens(ids)
    for skip in (True, False):
        assert shared.decode(ids, skip_special_tokens=skip) == loaded.decode(ids, skip_special_tokens=skip)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert shared.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )
    for name in ("all_special_ids", "eos_token_id", "bos_token_id", "pad_token_id", "model_max_length", "padding_side"):
        assert getattr(shared, name) == getattr(loaded, name), name
    assert {i: str(t) for i, t in shared.added_tokens_decoder.items()} == {
        i: str(t) for i, t in loaded.added_tokens_decoder.items()
    }


def test_the_detokenizer_process_imports_no_torch():
    """What the spawned detokenizer imports before its tokenizer arrives."""
    code = (
        "import sys, radixserve.runtime.processes.child, radixserve.runtime.processes.detokenizer, radixserve.cli\n"
        "from radixserve.runtime.processes.tokenizer_share import import_tokenizer_modules\n"
        "import_tokenizer_modules()\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
