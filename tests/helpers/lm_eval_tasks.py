"""Three small lm_eval tasks of Python code, written as a user writes their own: a YAML file per task and its
documents in a JSONL file beside it (read through the `datasets` "json" builder: nothing is downloaded).
One task per kind of request: multiple choice (``loglikelihood``), perplexity (``loglikelihood_rolling``)
and generation (``generate_until``)."""

from __future__ import annotations

import json
from pathlib import Path

TASKS = ["tiny_choice", "tiny_rolling", "tiny_generate"]

CHOICES = [  # which keyword comes next
    {"context": "def add(a, b):\n    ", "choices": ["return a + b", "import os", "class A:"], "answer": 0},
    {"context": "for i in range(10):\n    ", "choices": ["lambda", "print(i)", "except:"], "answer": 1},
    {"context": "import os\nimport ", "choices": ["= 3", "sys", ")"], "answer": 1},
    {"context": "class Point:\n    def ", "choices": ["__init__(self):", "+= 1", "import"], "answer": 0},
    {"context": "if x is None:\n    ", "choices": ["return None", "def", "]"], "answer": 0},
    {"context": "", "choices": ["import os", "@@@@"], "answer": 0},  # empty context: the eot token
]
TEXTS = [  # some longer than the test model's 64 positions: several rolling windows
    "def f(x):\n    return x * 2\n",
    "import sys\n\n\ndef main(argv):\n    for arg in argv:\n        print(arg)\n    return 0\n\n\n"
    "if __name__ == '__main__':\n    sys.exit(main(sys.argv))\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n",
]
PROMPTS = [
    {"prompt": "def add(a, b):\n    return", "answer": " a + b"},
    {"prompt": "import os\nimport", "answer": " sys"},
    {"prompt": "for i in range(", "answer": "10):"},
    {"prompt": "class A:\n    def __init__(self", "answer": "):"},
]


def write_tasks(folder: Path, max_gen_toks: int = 12) -> Path:
    """The three tasks' YAML and JSONL files in ``folder`` (lm_eval's ``include_path``); returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    texts = [{"text": text} for text in TEXTS]
    documents = {"tiny_choice": CHOICES, "tiny_rolling": texts, "tiny_generate": PROMPTS}
    for task, rows in documents.items():
        (folder / f"{task}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    kinds = {
        "tiny_choice": (
            "output_type: multiple_choice\ndoc_to_text: '{{context}}'\ndoc_to_choice: '{{choices}}'\n"
            "doc_to_target: '{{answer}}'\ntarget_delimiter: ''\n"
            "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
        ),
        "tiny_rolling": (
            "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
            "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n"
            "  - metric: bits_per_byte\n"
        ),
        "tiny_generate": (
            "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{answer}}'\n"
            "target_delimiter: ''\n"
            f"generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: {max_gen_toks}\n  do_sample: false\n"
            "metric_list:\n  - metric: exact_match\n"
        ),
    }
    for task, kind in kinds.items():
        (folder / f"{task}.yaml").write_text(
            f"task: {task}\ndataset_path: json\n"
            f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(folder / f'{task}.jsonl'))}\n"
            f"test_split: test\n{kind}"
        )
    return folder
