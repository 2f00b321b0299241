"""A worker process that renders chat templates that are not the operator's (see
request_template.py).

Run as a script by its path (it imports nothing of Shoal's, so no sys.path or main
module matters): it limits its own address space, then answers one line of JSON on
stdout for each line of JSON on stdin, until stdin closes:

- `{"load": key, "json": ...}`: keep that tokenizer (a `tokenizers` JSON) by its key,
  the least recently used one dropped past a few; `{"loaded": true}`.
- a render job: the template's text, bounded by `max_chars` characters and, with a
  `tokenizer` key, by `max_tokens` of its tokens, counted here (`{"missing": key}` when
  it is not loaded: the parent loads it and asks again); `{"text": ..., "num_tokens":
  ...}` or `{"error": ...}`.

Each line may use at most the CPU time given (past it the kernel ends the process: a
backstop for the parent's own timer, should the parent be gone).
"""

import json
import resource
import sys
from collections import OrderedDict

LOAD_CPU_S = 60  # to read a tokenizer (a large vocabulary's takes a second or two)


class Overrun(Exception):
    """The render wrote more than its bound."""


def main() -> None:
    import tokenizers
    from transformers.utils.chat_template_utils import render_jinja_template

    memory_bytes, cpu_s, max_loaded = (int(a) for a in sys.argv[1:4])
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    loaded: OrderedDict[str, tokenizers.Tokenizer] = OrderedDict()
    _answer({"ready": True})
    for line in sys.stdin:
        try:
            job = json.loads(line)
            _cpu_limit(LOAD_CPU_S if "load" in job else cpu_s)
            if "load" in job:
                while len(loaded) >= max_loaded:
                    loaded.popitem(last=False)
                loaded[job["load"]] = tokenizers.Tokenizer.from_str(job["json"])
                _answer({"loaded": True})
                continue
            key = job["tokenizer"]
            if key is not None and key not in loaded:
                _answer({"missing": key})
                continue
            rendered, _ = render_jinja_template(
                conversations=[job["messages"]],
                tools=job["tools"],
                chat_template=job["template"],
                add_generation_prompt=job["ending"] == "reply",
                continue_final_message=job["ending"] == "continue",
                **job["variables"],
            )
            text = rendered[0]
            max_chars, max_tokens = job["max_chars"], job["max_tokens"]
            if len(text) > max_chars:
                raise Overrun(f"it rendered over {max_chars} characters{_held(max_tokens)}")
            num_tokens = None
            if key is not None:
                loaded.move_to_end(key)
                num_tokens = len(loaded[key].encode(text, add_special_tokens=False).ids)
                if max_tokens is not None and num_tokens > max_tokens:
                    raise Overrun(
                        f"it rendered {num_tokens} tokens; the model's context holds {max_tokens}"
                    )
            _answer({"text": text, "num_tokens": num_tokens})
        except Overrun as exc:
            _answer({"error": str(exc)})
        except MemoryError:
            # What the render left (transformers' cache of compiled templates, a
            # fragmented heap) may leave the next one too little: a new worker instead.
            _answer({"error": "it ran out of memory", "spent": True})
            return
        except Exception as exc:  # the template's own errors, raise_exception included
            _answer({"error": f"{type(exc).__name__}: {exc}"})


def _held(max_tokens: int | None) -> str:
    if max_tokens is None:
        return ""
    return f", more than the model's context ({max_tokens} tokens) holds"


def _cpu_limit(seconds: int) -> None:
    """Let this line use `seconds` more of CPU (and a margin), no more."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    used = usage.ru_utime + usage.ru_stime
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = int(used) + seconds + 2
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _answer(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
