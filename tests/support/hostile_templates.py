"""A chat template a hostile model file could carry: it renders a conversation normally (so it
passes the loader's trial render) and runs away when a message's content names a trap."""

TRAPS = {   # message content -> what the render then does
    "loop": "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
    "big": "{{ 'x' * 30000000 }}",
    "memory": "{{ 'x' | center(4000000000) }}",
    "double": "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
              "{{ ns.s }}",
    "recurse": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "range": "{{ range(10 ** 9) | list }}",
    "divide": "{{ 1 / 0 }}",
}
# the error code each trap gets: limits (time, output, memory) or a failing render
TRAP_CODES = {"loop": "chat_template_limit", "big": "chat_template_limit", "memory": "chat_template_limit",
              "double": "chat_template_limit", "recurse": "chat_template_limit", "range": "chat_template_error",
              "divide": "chat_template_error"}


def trapped(message: str, after: str = "") -> str:
    """The template: each message rendered by `message` (Jinja, `m` is the message) unless it
    names a trap; `after` follows the loop."""
    traps = "".join(f"{{% if m.content == '{name}' %}}{body}{{% endif %}}" for name, body in TRAPS.items())
    return "{% for m in messages %}" + traps + message + "{% endfor %}" + after
