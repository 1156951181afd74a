"""Whole conversations of the assistant's closed world, as OpenAI-style chat rows.

`conversation(rng, kind)` returns a `Dialog`: `messages` (ending with the assistant turn to learn or to
check), `tools` (OpenAI function declarations, or None), `thinking` (the template's enable_thinking) and
`expect`, what a right final turn does, which the eval scores:
    {"kind": "answer" | "json" | "call" | "no_call" | "tool_answer", "row": table row, "answer": canonical
     content, "answers": its other exact forms (a conversion's plain and worked ones), "data": JSON value,
     "calls": [[name, args]], "uses": [strings the answer must contain],
     "thought": whether the final turn opens with a thought channel}
Kinds: `skill` (one question, maybe after an unrelated exchange, tools that do not fit maybe declared),
`json` (the answer as JSON, asked in the question or by the system turn), `call` (weather, time, a
calculation beyond its skill or a timer, with the fitting tool declared: the turn is the call), `tool_answer`
(the same after the tool's response: the answer quotes it), `no_call` (the fitting tool is not declared: say
so), `followup` (a second question that refers back to the first exchange).
The final assistant message carries `reasoning_content` (the working) when thinking is on and the turn opens
fresh; a turn continuing after tool responses does not think again.
"""

from __future__ import annotations

import functools
import json
import random
from contextvars import ContextVar
from dataclasses import dataclass

from . import skills as sk


def _fn(name: str, description: str, props: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": props, "required": required}}}


TOOLS = {
    "get_weather": _fn("get_weather", "Current weather in a city", {"city": {"type": "string"}}, ["city"]),
    "get_time": _fn("get_time", "Current local time in a city", {"city": {"type": "string"}}, ["city"]),
    "calculate": _fn("calculate", "Evaluate an arithmetic expression", {"expression": {"type": "string"}},
                     ["expression"]),
    "set_timer": _fn("set_timer", "Start a countdown timer", {"minutes": {"type": "integer"}}, ["minutes"]),
}
CITIES = ["Paris", "London", "Tokyo", "Berlin", "Rome", "Madrid", "Oslo", "Cairo", "Lima", "Delhi", "Seoul",
          "Sydney", "Toronto", "Chicago", "Boston", "Dublin", "Vienna", "Prague", "Lisbon", "Athens", "Nairobi",
          "Bangkok", "Mexico City", "New York", "Cape Town", "Buenos Aires", "Istanbul", "Moscow", "Beijing", "Dubai"]
CONDITIONS = ["sunny", "cloudy", "rainy", "snowy", "windy", "foggy", "stormy", "clear"]
SYSTEMS = ["You are a helpful assistant.", "You are a concise assistant.", "Answer briefly.",
           "You are a friendly helper for quick questions."]
JSON_SYSTEMS = ["Reply only with JSON.", "Always answer in JSON."]
JSON_ASK = [" Answer in JSON.", " Reply with JSON only.", " Give the answer as JSON.", " Respond in JSON format."]
KINDS = {"skill": 0.46, "json": 0.09, "call": 0.12, "tool_answer": 0.12, "no_call": 0.07, "followup": 0.14}


@dataclass
class Dialog:
    messages: list[dict]
    tools: list[dict] | None
    thinking: bool
    expect: dict
    keys: tuple = ()  # skill keys of every item used (held-out exclusion)

    def row(self) -> dict:
        """The JSONL training row (`blockpress train` chat format, tools and thinking included)."""
        out = {"messages": self.messages}
        if self.tools:
            out["tools"] = self.tools
        if self.thinking:
            out["enable_thinking"] = True
        return out


def _assistant(content: str, working: str | None, thinking: bool, calls: list | None = None) -> dict:
    m = {"role": "assistant", "content": content}
    if thinking and working:
        m["reasoning_content"] = working
    if calls:
        m["tool_calls"] = [{"id": f"call_{i}", "type": "function",
                            "function": {"name": n, "arguments": json.dumps(a)}} for i, (n, a) in enumerate(calls)]
    return m


def _tools(rng: random.Random, need: str | None = None, avoid: tuple[str, ...] = ()) -> list[dict] | None:
    """A random subset of the tools in their fixed order, containing `need`, none of `avoid`."""
    names = [n for n in TOOLS if n not in avoid and n != need and rng.random() < 0.5]
    if need:
        names.append(need)
    return [TOOLS[n] for n in TOOLS if n in names] or None


# ------------------------------------------------------------------------------------------- tool requests
@dataclass
class Request:
    tool: str
    question: str
    args: dict
    why: str  # why a tool is needed (the working, completed by call_working / no_tool_working)
    refusal: str  # answer without the tool
    response: dict  # what the tool returns
    answer: str  # answer from the response
    uses: list[str]
    data: dict | None = None  # JSON form of the answer

    def call_working(self, n: int = 1) -> str:
        if n > 1:
            return self.why.replace(self.args["city"], "each city") + f", so I call {self.tool} once per city."
        return self.why + f", so I call {self.tool}."

    def no_tool_working(self) -> str:
        return self.why + f", and no {self.tool} tool is declared, so I say so."


def _big_calc(rng: random.Random) -> tuple[str, int, int, int]:
    op = rng.choice(["add", "sub", "mul"])
    if op == "mul":
        a, b = sk._digits(rng, rng.randint(3, 4)), sk._digits(rng, rng.randint(2, 3))
    else:
        a, b = sk._digits(rng, rng.randint(4, 6)), sk._digits(rng, rng.randint(3, 6))
        a, b = (a, b) if op == "add" or a >= b else (b, a)
    return op, a, b, {"add": a + b, "sub": a - b, "mul": a * b}[op]


def request(rng: random.Random, tool: str | None = None, city: str | None = None) -> Request:
    tool = tool or rng.choices(list(TOOLS), [4, 3, 3, 1])[0]
    city = city or rng.choice(CITIES)
    if tool == "get_weather":
        temp, cond = rng.randint(-10, 35), rng.choice(CONDITIONS)
        q = sk._pick(rng, ["What's the weather in {c}?", "What is the weather like in {c} right now?",
                           "How warm is it in {c} today?", "Is it raining in {c}?", "Weather in {c}?"], c=city)
        return Request(tool, q, {"city": city}, f"The user wants the current weather in {city}, which needs live "
                       "data",
                       f"I can't check the weather in {city}: I have no weather tool here.",
                       {"temperature_c": temp, "condition": cond}, f"It is {temp}°C and {cond} in {city}.",
                       [str(temp), cond], {"city": city, "temperature_c": temp, "condition": cond})
    if tool == "get_time":
        t = f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
        q = sk._pick(rng, ["What time is it in {c}?", "What's the local time in {c}?", "Tell me the time in {c}.",
                           "Current time in {c}?"], c=city)
        return Request(tool, q, {"city": city}, f"The user wants the current time in {city}, and I have no clock",
                       f"I can't tell the time in {city}: I have no clock tool here.", {"time": t},
                       f"It is {t} in {city}.", [t], {"city": city, "time": t})
    if tool == "calculate":
        op, a, b, c = _big_calc(rng)
        sym, asc = sk.SYMBOL[op], {"add": "+", "sub": "-", "mul": "*"}[op]
        q = sk._pick(rng, {"add": sk.ADD_Q, "sub": sk.SUB_Q, "mul": sk.MUL_Q}[op], a=a, b=b)
        return Request(tool, q, {"expression": f"{a} {asc} {b}"},
                       f"{a} {sym} {b} is too big to do reliably in my head",
                       f"{a} {sym} {b} is too big for me to work out reliably without a calculator tool.",
                       {"result": c}, f"{a} {sym} {b} = {c}.", [str(c)], {"result": c})
    m = rng.choice([1, 2, 3, 5, 10, 15, 20, 25, 30, 45, 60, 90]) if rng.random() < 0.7 else rng.randint(1, 120)
    q = sk._pick(rng, ["Set a timer for {m} minutes.", "Start a {m} minute timer.", "Can you set a {m}-minute timer?",
                       "Remind me in {m} minutes."], m=m)
    return Request(tool, q.replace(" 1 minutes", " 1 minute"), {"minutes": m},
                   f"The user wants a {m}-minute timer, which I cannot run myself",
                   "I can't set timers: I have no timer tool here.", {"status": "running", "minutes": m},
                   f"Your {m}-minute timer is running.", [str(m)], {"minutes": m, "status": "running"})


def _tool_messages(rng: random.Random, reqs: list[Request]) -> list[dict]:
    """The assistant's call message + one tool message per call (content: a JSON string, sometimes an object)."""
    msgs = [_assistant("", None, False, [(r.tool, r.args) for r in reqs])]
    for i, r in enumerate(reqs):
        content = r.response if rng.random() < 0.2 else json.dumps(r.response)
        msgs.append({"role": "tool", "tool_call_id": f"call_{i}", "name": r.tool, "content": content})
    return msgs


def _lead(rng: random.Random, thinking: bool, json_system: bool = False) -> list[dict]:
    if json_system:
        return [{"role": "system", "content": rng.choice(JSON_SYSTEMS)}]
    return [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.3 else []


# The most earlier exchanges a conversation opens with (`_prior`). 1: one exchange in a quarter of the conversations,
# the stream every stage before 29 trained on; k > 1: 1 to k exchanges in two thirds of them, half of those small
# talk, so that a chat of several turns (what `blockpress chat` is) is what the model saw (scripts/prepare_chat.py
# --history; stage 29 of scripts/finetune_chat.py).
HISTORY: ContextVar[int] = ContextVar("HISTORY", default=1)


def _prior(rng: random.Random) -> tuple[list[dict], tuple]:
    """Maybe earlier, unrelated exchanges (context the model must look past): `HISTORY` says how many."""
    most = HISTORY.get()
    if rng.random() >= (0.25 if most == 1 else 2 / 3):
        return [], ()
    msgs, keys = [], ()
    for _ in range(1 if most == 1 else rng.randint(1, most)):
        if most > 1 and rng.random() < 0.5:
            phrasings, reply, _ = TALK[rng.choice(list(TALK))]
            msgs += [{"role": "user", "content": rng.choice(phrasings)}, {"role": "assistant", "content": reply}]
            continue
        it = sk.any_item(rng)
        msgs += [{"role": "user", "content": it.question}, {"role": "assistant", "content": it.answer}]
        keys += (it.key,)
    return msgs, keys


def _also(it: sk.Item) -> dict:
    """The other exact forms of an answer the eval takes (a conversion's plain and worked forms), if it has any."""
    return {"answers": list(it.extra["answers"])} if "answers" in it.extra else {}


# ------------------------------------------------------------------------------------------- kinds
def conversation(rng: random.Random, kind: str | None = None, item: sk.Item | None = None) -> Dialog:
    kind = kind or rng.choices(list(KINDS), list(KINDS.values()))[0]
    thinking = rng.random() < 0.5
    return {"skill": _skill, "json": _json, "call": _call, "tool_answer": _tool_answer, "no_call": _no_call,
            "no_call_offered": functools.partial(_no_call, offered=True),
            "followup": _followup, "smalltalk": _smalltalk}[kind](rng, thinking, item)


# ------------------------------------------------------------------------------------------- small talk
# What people type first to a chat model, each with the one reply the assistant gives (and its working): a closed
# set of phrasings, so the eval's "small talk" row measures that a seen kind of message gets its reply. Not in
# KINDS (the from-scratch stream is unchanged); drill sets ask for it (`smalltalk`).
TALK = {  # intent: (phrasings, reply, working); the replies short: a tiny model learns a long new one slowly
    "greet": (["Hi", "Hello", "Hey", "Hi there", "Hello there", "Hey there", "Good morning", "Good afternoon",
               "Good evening", "Greetings", "Howdy"], "Hello! How can I help?", "A greeting: I greet back."),
    "how": (["How are you?", "How are you doing?", "How's it going?", "How are you today?", "Are you well?"],
            "I am well, thank you!", "A friendly question: I answer briefly."),
    "who": (["Who are you?", "What are you?", "What is your name?", "What's your name?", "Are you a robot?",
             "Introduce yourself.", "Tell me about yourself."], "I am a small assistant.",
            "A question about me: I say what I am."),
    "can": (["What can you do?", "How can you help?", "How can you help me?", "What are you good at?",
             "What do you do?", "Help", "Help me.", "What are your skills?"],
            "I do arithmetic, units, letters and dates.", "A question about my skills: I name them."),
    "thanks": (["Thanks", "Thank you", "Thanks a lot", "Thank you very much", "Great, thanks", "Cheers",
                "Thanks for the help"], "You're welcome!", "Thanks: I say you're welcome."),
    "bye": (["Bye", "Goodbye", "See you", "See you later", "Bye for now", "Good night"], "Goodbye!",
            "A goodbye: I say goodbye."),
    "other": (["Tell me a joke.", "Write a poem.", "Write a story.", "Sing a song.", "What is the capital of France?",
               "Who won the World Cup?", "What is the meaning of life?", "Recommend a book.",
               "Translate hello into French.", "What is love?", "Draw a cat.", "Who is the president?",
               "Write me an essay.", "What should I eat tonight?", "Explain quantum physics.",
               "Play a game with me."], "Sorry, I can't help with that.", "A request outside my skills: I say so."),
}


def _smalltalk(rng, thinking, item=None) -> Dialog:
    """A greeting, a question about the assistant, thanks, a goodbye or a request outside its skills, maybe after an
    earlier exchange (thanks after an answer), tools that do not fit maybe declared: answered with its reply."""
    phrasings, reply, working = TALK[rng.choice(list(TALK))]
    q = rng.choice(phrasings)
    if q[-1] not in "?.":  # "Hi", "hi!", "Hi."
        q = (q if rng.random() < 0.7 else q.lower()) + rng.choice(["", "!", "."])
    prior, keys = _prior(rng)
    msgs = _lead(rng, thinking) + prior + [{"role": "user", "content": q}, _assistant(reply, working, thinking)]
    return Dialog(msgs, _tools(rng) if rng.random() < 0.3 else None, thinking,
                  {"kind": "answer", "row": "small talk", "answer": reply, "thought": thinking}, keys)


def _skill(rng, thinking, item=None) -> Dialog:
    it = item or sk.any_item(rng)
    prior, keys = _prior(rng)
    tools = _tools(rng) if rng.random() < 0.3 else None  # none of them fits a question it can answer itself
    msgs = _lead(rng, thinking) + prior + [{"role": "user", "content": it.question},
                                           _assistant(it.answer, it.working, thinking)]
    return Dialog(msgs, tools, thinking, {"kind": "answer", "row": it.skill, "answer": it.answer,
                                          **_also(it), "thought": thinking}, keys + (it.key,))


def _json(rng, thinking, item=None) -> Dialog:
    it = item or sk.any_item(rng)
    by_system = rng.random() < 0.3
    q = it.question if by_system else it.question + rng.choice(JSON_ASK)
    ans = json.dumps(it.data)
    msgs = _lead(rng, thinking, by_system) + [{"role": "user", "content": q}, _assistant(ans, it.working, thinking)]
    return Dialog(msgs, _tools(rng) if rng.random() < 0.2 else None, thinking,
                  {"kind": "json", "row": "json", "answer": ans, "data": it.data, "thought": thinking}, (it.key,))


def _requests(rng: random.Random) -> list[Request]:
    r = request(rng)
    if r.tool in ("get_weather", "get_time") and rng.random() < 0.15:  # two cities, two calls
        other = rng.choice([c for c in CITIES if c != r.args["city"]])
        q2 = r.question.rstrip("?.") + f" and in {other}?"
        r2 = request(rng, r.tool, other)
        r.question = q2
        return [r, r2]
    return [r]


def _call_turn(reqs: list[Request], thinking: bool) -> dict:
    return _assistant("", reqs[0].call_working(len(reqs)), thinking, [(r.tool, r.args) for r in reqs])


def _call(rng, thinking, item=None) -> Dialog:
    reqs = _requests(rng)
    prior, keys = _prior(rng)
    msgs = _lead(rng, thinking) + prior + [{"role": "user", "content": reqs[0].question}, _call_turn(reqs, thinking)]
    return Dialog(msgs, _tools(rng, need=reqs[0].tool), thinking,
                  {"kind": "call", "row": "tool call", "calls": [[r.tool, r.args] for r in reqs], "thought": thinking},
                  keys)


def _answer_from(rng: random.Random, reqs: list[Request], as_json: bool) -> tuple[str, list[str], object]:
    if as_json:
        data = reqs[0].data if len(reqs) == 1 else [r.data for r in reqs]
        return json.dumps(data), [u for r in reqs for u in r.uses], data
    return " ".join(r.answer for r in reqs), [u for r in reqs for u in r.uses], None


def _tool_answer(rng, thinking, item=None) -> Dialog:
    reqs = _requests(rng)
    as_json = rng.random() < 0.2
    q = reqs[0].question + (rng.choice(JSON_ASK) if as_json else "")
    ans, uses, data = _answer_from(rng, reqs, as_json)
    msgs = _lead(rng, thinking) + [{"role": "user", "content": q}] + _tool_messages(rng, reqs) + \
        [_assistant(ans, None, False)]
    return Dialog(msgs, _tools(rng, need=reqs[0].tool), thinking,
                  {"kind": "tool_answer", "row": "tool answer", "answer": ans, "uses": uses, "data": data,
                   "thought": False})


def _no_call(rng, thinking, item=None, offered: bool | None = None) -> Dialog:
    """A request the fitting tool is not declared for, answered in words; other tools are declared half the time
    (`offered` None), or always ("no_call_offered", a drill: the mistake a small model makes is to call the
    undeclared tool while others are declared)."""
    r = request(rng)
    msgs = _lead(rng, thinking) + [{"role": "user", "content": r.question}, _assistant(
        r.refusal, r.no_tool_working(), thinking)]
    offer = rng.random() < 0.5 if offered is None else offered
    return Dialog(msgs, _tools(rng, avoid=(r.tool,)) if offer else None, thinking,
                  {"kind": "no_call", "row": "no tool fits", "answer": r.refusal, "thought": thinking})


FOLLOW_ADD = ["Now add {k} to that.", "And if you add {k}?", "Add {k} to the result.", "What is that plus {k}?"]
FOLLOW_SUB = ["Now subtract {k} from that.", "And minus {k}?", "Take {k} away from the result."]
FOLLOW_MUL = ["Now multiply that by {k}.", "And times {k}?", "Multiply the result by {k}."]
FOLLOW_CITY = ["And in {c}?", "What about {c}?", "And for {c}?"]
CHAINS = {0: 1, 1: 2, 8: 7}  # conversion index -> the next unit down (km -> m -> cm -> mm; week -> day -> hour)


def _followup(rng, thinking, item=None) -> Dialog:
    kind = rng.choices(["arith", "conv", "letters", "tool"], [5, 2, 2, 3])[0]
    if kind == "tool":
        r = request(rng, rng.choice(["get_weather", "get_time"]))
        city = r.args["city"]
        if rng.random() < 0.5:  # same tool, another city
            r2 = request(rng, r.tool, rng.choice([c for c in CITIES if c != city]))
            q2 = sk._pick(rng, FOLLOW_CITY, c=r2.args["city"])
        else:  # the other tool, same city ("there")
            r2 = request(rng, "get_time" if r.tool == "get_weather" else "get_weather", city)
            q2 = "And what time is it there?" if r2.tool == "get_time" else "And what's the weather there?"
        msgs = [{"role": "user", "content": r.question}] + _tool_messages(rng, [r]) + \
            [_assistant(r.answer, None, False), {"role": "user", "content": q2}, _call_turn([r2], thinking)]
        return Dialog(_lead(rng, thinking) + msgs, _tools(rng, need=r.tool) if r2.tool == r.tool else
                      [TOOLS["get_weather"], TOOLS["get_time"]], thinking,
                      {"kind": "call", "row": "follow-up", "calls": [[r2.tool, r2.args]], "thought": thinking})
    if kind == "arith":
        first = sk.arithmetic(rng, digits=rng.choice([(2, 1), (2, 2)]))
        x = first.extra["result"]
        op = "mul" if x < 100 and x > 1 and rng.random() < 0.3 else rng.choice(["add", "sub"]) if x > 9 else "add"
        k = rng.randint(2, 9) if op == "mul" else rng.randint(1, min(99, x) if op == "sub" else 99)
        second = sk.arithmetic_item(op, x, k, rng)
        q2 = sk._pick(rng, {"add": FOLLOW_ADD, "sub": FOLLOW_SUB, "mul": FOLLOW_MUL}[op], k=k)
    elif kind == "conv":
        idx = rng.choice(list(CHAINS))
        first = sk.conversion(rng, idx, reverse=False)
        nxt = sk.CONVERSIONS[CHAINS[idx]]
        second = sk.conversion(rng, CHAINS[idx], value=first.extra["value"], reverse=False)
        q2 = rng.choice([f"And in {nxt[6]}?", f"How many {nxt[6]} is that?", f"And how many {nxt[3]} is that?"])
    else:
        first = sk.letters(rng, kind=rng.choice(["length", "first"]))
        second = sk.letters(rng, first.extra["word"], "count")
        ch = second.key[2]
        q2 = rng.choice([f"And how many {ch}'s does it have?", f"How many times does {ch} appear in it?"])
    msgs = _lead(rng, thinking) + [{"role": "user", "content": first.question},
                                   {"role": "assistant", "content": first.answer},
                                   {"role": "user", "content": q2}, _assistant(second.answer, second.working, thinking)]
    return Dialog(msgs, None, thinking, {"kind": "answer", "row": "follow-up", "answer": second.answer,
                                         **_also(second), "thought": thinking}, (first.key,))
