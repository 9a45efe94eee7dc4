"""axolotl's EBFT dataset types (`datasets: [{type: ebft_opencode.transform}]`) as our `data.transform`s.

axolotl's versions (axolotl.prompt_strategies.ebft) tokenize for its strided trainer; ours hand back
text, which the driver tokenizes itself: the prompt (a conversation, or text without a chat
template) and the `ground_truth` the samples are feature-matched against. Like axolotl's, they keep
none of the original columns (its remove_columns "__all__"). driver/axolotl/keys.py names them
(BUILTIN_DATASET_TYPES) when it translates such a config; the chat ones are in driver/ebft/transforms.py.
"""

from __future__ import annotations


def ebft_opencode(row: dict) -> dict:
    """nvidia/OpenCodeInstruct's {input, output}: the input as the user's turn, the output as ground truth."""
    if "input" not in row or "output" not in row:
        raise ValueError(f"ebft_opencode needs 'input' and 'output' columns; columns are {sorted(row)}")
    return {"prompt": [{"role": "user", "content": row["input"]}], "ground_truth": row["output"]}


def ebft_strided_structured(row: dict) -> dict:
    """(prompt, completion) rows for strided EBFT, as plain text: anchors fall in the completion only.
    Reads the first present of input / prompt / question and of output / completion / answer."""
    prompt = _first_present(row, ("input", "prompt", "question"))
    return {"prompt": prompt, "ground_truth": _first_present(row, ("output", "completion", "answer"))}


def ebft_pretrain(row: dict) -> dict:
    """Raw text for strided EBFT: the whole document is the prompt column (ebft.ground_truth_field: null),
    from the question or, without one, the text column."""
    return {"prompt": _first_present(row, ("question", "text"))}


def _first_present(row: dict, columns: tuple[str, ...]) -> str:
    """axolotl's example.get(a, example.get(b, "")): the first column the row has, else empty text."""
    for column in columns:
        if column in row:
            return row[column]
    return ""
