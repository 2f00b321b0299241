"""The child process that renders requests' own chat templates (see request_template.py).

Run as a script by its path (it imports nothing of Shoal's, so no sys.path or main
module matters): it limits its own address space, then renders one job per line of
JSON on stdin, answering one line of JSON on stdout, until stdin closes.
"""

import json
import resource
import sys


def main() -> None:
    from transformers.utils.chat_template_utils import render_jinja_template

    memory_bytes, max_chars = int(sys.argv[1]), int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    _answer({"ready": True})
    for line in sys.stdin:
        try:
            job = json.loads(line)
            rendered, _ = render_jinja_template(
                conversations=[job["messages"]],
                tools=job["tools"],
                chat_template=job["template"],
                add_generation_prompt=job["ending"] == "reply",
                continue_final_message=job["ending"] == "continue",
                **job["variables"],
            )
            text = rendered[0]
            if len(text) > max_chars:
                raise ValueError(f"it rendered over {max_chars} characters")
            _answer({"text": text})
        except MemoryError:
            _answer({"error": "it ran out of memory"})
        except Exception as exc:  # the template's own errors, raise_exception included
            _answer({"error": f"{type(exc).__name__}: {exc}"})


def _answer(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
