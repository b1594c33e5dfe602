"""Chat prompts for distilling SmolLM2-135M-Instruct's draft, written here from templates x topics.

They are of the three kinds the bench asks about (edgespec/bench_prompts.jsonl: open questions,
code edits, summaries) with different content: the bench's prompts are the evaluation set, so no
topic, snippet or passage of theirs appears here (``test_smollm2.py`` checks the overlap).

Two rounds, because two kinds need text to work on:

1. ``first_round``: open questions (question templates x topics), "write a Python function"
   requests, and edits of the snippets below;
2. ``second_round``: summaries of the target's own answers from round 1 (its paragraphs are
   the passages) and edits of the functions it wrote (the code in its replies).

Everything is pure Python and seeded: the same seed gives the same prompts.
"""

from __future__ import annotations

import random
import re

TOPICS = [
    "volcanoes", "the water cycle", "photosynthesis", "black holes", "the Roman Empire",
    "electric cars", "coral reefs", "the human heart", "earthquakes", "solar panels",
    "honey production", "the printing press", "vaccines", "glaciers", "the stock market",
    "recycling plastic", "the Moon's phases", "rainforests", "jazz music", "chess openings",
    "bread baking", "the immune system", "wind turbines", "the Great Wall of China",
    "sleep and memory", "compound interest", "the internet", "bicycles", "owls", "tea",
    "climate change", "the Olympic Games", "DNA", "rainbows", "tides", "the piano",
    "public transport", "composting", "dinosaurs", "the Renaissance", "submarines", "coffee",
    "migratory birds", "the periodic table", "password security", "time zones", "deserts",
    "marathon training", "origami", "the telescope", "antibiotics", "lighthouses",
    "machine learning", "the French Revolution", "penguins", "batteries", "gardening",
    "meditation", "the Amazon river", "wolves", "cheese making", "satellites", "fungi",
    "the metric system", "ancient Egypt", "hurricanes", "budgeting", "octopuses",
]

QUESTIONS = [
    "What is {topic}? Explain it in a short paragraph.",
    "Explain how {topic} works to a ten-year-old.",
    "Give me three interesting facts about {topic}.",
    "Why is {topic} important?",
    "Write a short paragraph about {topic}.",
    "What are the pros and cons of {topic}?",
    "How would you describe {topic} to someone who has never heard of it?",
    "List four things everyone should know about {topic}.",
    "What is a common misconception about {topic}?",
    "Tell me the history of {topic} briefly.",
]

FUNCTIONS = [
    "reverses a string", "checks whether a number is prime", "counts the vowels in a string",
    "returns the factorial of n", "merges two sorted lists", "removes duplicates from a list",
    "returns the n-th Fibonacci number", "checks whether a string is a palindrome",
    "converts Celsius to Fahrenheit", "finds the smallest number in a list",
    "flattens a list of lists", "counts how often each word appears in a text",
    "returns the sum of the digits of an integer", "capitalizes every word in a sentence",
    "computes the median of a list", "checks whether two strings are anagrams",
    "returns the greatest common divisor of two numbers", "splits a list into chunks of size n",
    "converts a binary string to an integer", "returns the second largest number in a list",
    "reads a text file and returns its number of lines", "returns the longest word in a sentence",
    "computes the area of a circle", "checks whether a year is a leap year",
]

WRITE_FUNCTION = [
    "Write a Python function that {task}.",
    "Write a short Python function that {task}, with a docstring.",
    "Show me Python code for a function that {task}.",
]

SNIPPETS = [
    "def total_price(items):\n    total = 0\n    for item in items:\n        total = total + item['price']\n    return total",
    "def first_word(sentence):\n    words = sentence.split(' ')\n    return words[1]",
    "def is_even(n):\n    if n % 2 == 1:\n        return True\n    return False",
    "def repeat(text, times):\n    out = ''\n    for i in range(times):\n        out += text\n    return out",
    "def celsius(f):\n    return f - 32 * 5 / 9",
    "def last_item(values):\n    return values[len(values)]",
    "def greet(name):\n    print('Hello ' + name)\n\ngreet('Ada')",
    "def count_upper(text):\n    n = 0\n    for ch in text:\n        if ch.isupper():\n            n += 1\n    return n",
    "def positives(xs):\n    out = []\n    for x in xs:\n        if x > 0:\n            out.append(x)\n    return out",
    "def ratio(a, b):\n    return a / b",
    "def join_names(names):\n    s = ''\n    for n in names:\n        s = s + n + ', '\n    return s",
    "class Counter:\n    def __init__(self):\n        self.n = 0\n\n    def add(self):\n        self.n + 1",
    "def read_numbers(path):\n    f = open(path)\n    numbers = [int(line) for line in f]\n    return numbers",
    "def minimum(a, b):\n    if a > b:\n        return a\n    return b",
    "def contains(items, target):\n    for i in range(len(items)):\n        if items[i] == target:\n            return True\n        else:\n            return False",
    "def square_all(values):\n    result = []\n    for v in values:\n        result.append(v ** 2)\n    return result",
]

EDITS = [
    "Fix the bug in this Python code.",
    "Add type hints and a docstring to this code. Do not change what it does.",
    "Rewrite this code to be shorter and more Pythonic.",
    "Rename the variables in this code to clearer names and return the whole code.",
    "Explain what this code does, then suggest one improvement.",
    "Add error handling to this function.",
    "Rewrite this function using a list comprehension or a built-in function where it helps.",
    "Add comments to this code.",
]

SUMMARIES = [
    "Summarize the following text in one sentence.",
    "Summarize this passage in two sentences.",
    "Give a short summary of the text below.",
    "Summarize the following for a child in three short sentences.",
    "Write three bullet points that summarize this text.",
    "What is the main point of this text? Answer briefly.",
]


def _user(kind: str, content: str) -> dict:
    return {"kind": kind, "messages": [{"role": "user", "content": content}]}


def first_round_sizes() -> tuple[int, int, int]:
    """How many distinct prompts of each kind first_round can draw."""
    return (len(QUESTIONS) * len(TOPICS), len(WRITE_FUNCTION) * len(FUNCTIONS),
            len(EDITS) * len(SNIPPETS))


def first_round(seed: int, questions: int, functions: int, edits: int) -> list[dict]:
    """Round 1: ``questions`` open questions, ``functions`` requests for a Python function,
    ``edits`` edit requests over SNIPPETS; each a ``{"kind", "messages"}`` record, in a seeded
    shuffled order drawn without repetition where the templates allow."""
    rng = random.Random(seed)
    asked = rng.sample([q.format(topic=t) for q in QUESTIONS for t in TOPICS], questions)
    written = rng.sample([w.format(task=f) for w in WRITE_FUNCTION for f in FUNCTIONS], functions)
    edited = rng.sample([f"{e}\n\n{s}" for e in EDITS for s in SNIPPETS], edits)
    prompts = ([_user("question", q) for q in asked] + [_user("code", w) for w in written]
               + [_user("code", e) for e in edited])
    rng.shuffle(prompts)
    return prompts


def second_round(replies: list[tuple[dict, str]], seed: int, limit: int) -> list[dict]:
    """Round 2 from round 1's (prompt, reply) pairs: a summary request over each prose reply
    long enough to summarize, and an edit request over the code of each reply that holds a
    function; at most ``limit`` of them, seeded."""
    rng = random.Random(seed)
    prompts = []
    for prompt, reply in replies:
        code = extract_code(reply)
        if code is not None:
            prompts.append(_user("code", f"{rng.choice(EDITS)}\n\n{code}"))
        elif prompt["kind"] == "question" and len(reply.split()) >= 60:
            prompts.append(_user("summarize", f"{rng.choice(SUMMARIES)}\n\n{reply.strip()}"))
    rng.shuffle(prompts)
    return prompts[:limit]


_FENCE = re.compile(r"```(?:python|py)?\n(.*?)```", re.DOTALL)


def extract_code(reply: str) -> str | None:
    """The first fenced code block of a reply that defines a function, None if there is none."""
    for block in _FENCE.findall(reply):
        if "def " in block and len(block.strip().splitlines()) >= 2:
            return block.strip()
    return None
