"""Helpers of the continuous-decoder tests (test_continuous_decoder.py, test_speculative.py)."""


def encode(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def drive(decoder, admissions: dict[int, list[tuple]]) -> dict:
    """Step ``decoder`` until idle, admitting ``admissions[step]`` (key, ids, params) before that step."""
    out, step = {}, 0
    while decoder.busy or step <= max(admissions):
        for key, ids, params in admissions.get(step, []):
            decoder.admit(key, ids, params)
        out.update({row.key: row for row in decoder.step()})
        step += 1
    return out
