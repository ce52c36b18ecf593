"""Build envs/data/code_problems.jsonl from the problems below (written for agentrl).

Each problem is a stdin -> stdout program. Expected outputs are produced by
running the reference solution on each input, so tests and solutions cannot
disagree; the reference solution ships too (demonstrations, data checks).
Run: `python envs/data/build_code_problems.py`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

PROBLEMS: list[dict[str, Any]] = [
    {
        "id": "sum_list", "split": "train", "title": "Sum of numbers",
        "statement": "The first line holds N. The second line holds N integers. Print their sum.",
        "solution": "n = int(input())\nprint(sum(map(int, input().split())) if n else 0)\n",
        "public": ["3\n1 2 3\n", "1\n-5\n"],
        "hidden": ["0\n\n", "5\n10 -10 10 -10 7\n", "4\n1000000000 1000000000 1000000000 1000000000\n",
                   "2\n-1 -1\n", "6\n1 1 1 1 1 1\n"],
    },
    {
        "id": "reverse_words", "split": "train", "title": "Reverse the words",
        "statement": "Read one line of words separated by single spaces. Print the words in reverse order, separated by single spaces.",
        "solution": "print(' '.join(input().split()[::-1]))\n",
        "public": ["hello world\n", "a b c\n"],
        "hidden": ["one\n", "the quick brown fox\n", "x y\n", "keep calm and carry on\n", "z\n"],
    },
    {
        "id": "fizzbuzz", "split": "train", "title": "FizzBuzz",
        "statement": "Read N. For i from 1 to N print one line: 'FizzBuzz' if i is divisible by 15, 'Fizz' if by 3, 'Buzz' if by 5, else i.",
        "solution": "n = int(input())\nfor i in range(1, n + 1):\n    print('FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 else 'Buzz' if i % 5 == 0 else i)\n",
        "public": ["5\n", "3\n"],
        "hidden": ["1\n", "15\n", "16\n", "30\n", "0\n"],
    },
    {
        "id": "max_min", "split": "train", "title": "Largest and smallest",
        "statement": "Read N on the first line and N integers on the second. Print the largest and the smallest, separated by a space.",
        "solution": "input()\nxs = list(map(int, input().split()))\nprint(max(xs), min(xs))\n",
        "public": ["3\n3 9 1\n", "1\n7\n"],
        "hidden": ["4\n-1 -2 -3 -4\n", "5\n5 5 5 5 5\n", "2\n100 -100\n", "6\n0 8 -8 3 9 -9\n", "3\n2 1 2\n"],
    },
    {
        "id": "palindrome", "split": "train", "title": "Palindrome check",
        "statement": "Read one line. Ignoring case and every character that is not a letter or digit, print YES if it reads the same backwards, else NO.",
        "solution": "s = [c.lower() for c in input() if c.isalnum()]\nprint('YES' if s == s[::-1] else 'NO')\n",
        "public": ["Racecar\n", "hello\n"],
        "hidden": ["A man, a plan, a canal: Panama\n", "ab\n", "x\n", "No lemon, no melon\n", "12321\n", "123\n"],
    },
    {
        "id": "count_vowels", "split": "train", "title": "Count vowels",
        "statement": "Read one line and print how many of its characters are vowels (a, e, i, o, u, in either case).",
        "solution": "print(sum(c in 'aeiouAEIOU' for c in input()))\n",
        "public": ["hello\n", "AEIOU xyz\n"],
        "hidden": ["rhythm\n", "Programming Is Fun\n", "a\n", "Queueing\n", "bcd fgh\n"],
    },
    {
        "id": "fibonacci", "split": "train", "title": "Fibonacci number",
        "statement": "Read N (0 <= N <= 90). Print the N-th Fibonacci number, where F(0) = 0 and F(1) = 1.",
        "solution": "n = int(input())\na, b = 0, 1\nfor _ in range(n):\n    a, b = b, a + b\nprint(a)\n",
        "public": ["0\n", "10\n"],
        "hidden": ["1\n", "2\n", "20\n", "50\n", "90\n"],
    },
    {
        "id": "primes_upto", "split": "train", "title": "Primes up to N",
        "statement": "Read N. Print all primes p with 2 <= p <= N on one line, separated by spaces (print an empty line if there are none).",
        "solution": ("n = int(input())\nprint(' '.join(str(p) for p in range(2, n + 1)"
                     " if all(p % d for d in range(2, int(p ** 0.5) + 1))))\n"),
        "public": ["10\n", "2\n"],
        "hidden": ["1\n", "30\n", "3\n", "50\n", "4\n"],
    },
    {
        "id": "word_frequency", "split": "train", "title": "Most frequent word",
        "statement": "Read one line of lowercase words separated by spaces. Print the most frequent word and its count, separated by a space. On a tie print the word that comes first alphabetically.",
        "solution": ("from collections import Counter\nc = Counter(input().split())\n"
                     "w = min(c, key=lambda k: (-c[k], k))\nprint(w, c[w])\n"),
        "public": ["a b a\n", "dog cat\n"],
        "hidden": ["x\n", "b b a a c\n", "the cat and the hat and the bat\n", "z y x w\n", "q q q q\n"],
    },
    {
        "id": "binary", "split": "train", "title": "To binary",
        "statement": "Read a non-negative integer N. Print N in base 2 without leading zeros (0 prints as 0).",
        "solution": "print(bin(int(input()))[2:])\n",
        "public": ["5\n", "0\n"],
        "hidden": ["1\n", "2\n", "255\n", "1024\n", "123456789\n"],
    },
    {
        "id": "running_sum", "split": "train", "title": "Running sums",
        "statement": "Read N on the first line and N integers on the second. Print the N prefix sums on one line, separated by spaces.",
        "solution": ("from itertools import accumulate\ninput()\n"
                     "print(' '.join(map(str, accumulate(map(int, input().split())))))\n"),
        "public": ["3\n1 2 3\n", "2\n5 -5\n"],
        "hidden": ["1\n9\n", "5\n1 1 1 1 1\n", "4\n-1 -2 -3 -4\n", "3\n100 0 -50\n", "6\n2 4 6 8 10 12\n"],
    },
    {
        "id": "anagrams", "split": "train", "title": "Anagrams",
        "statement": "Read two lines, each one lowercase word. Print YES if they are anagrams of each other, else NO.",
        "solution": "a = input().strip()\nb = input().strip()\nprint('YES' if sorted(a) == sorted(b) else 'NO')\n",
        "public": ["listen\nsilent\n", "abc\nabd\n"],
        "hidden": ["a\na\n", "ab\nabc\n", "evil\nvile\n", "aabb\nabab\n", "aab\nabb\n"],
    },
    {
        "id": "gcd_lcm", "split": "test", "title": "GCD and LCM",
        "statement": "Read two positive integers A and B on one line. Print their greatest common divisor and least common multiple, separated by a space.",
        "solution": "import math\na, b = map(int, input().split())\ng = math.gcd(a, b)\nprint(g, a * b // g)\n",
        "public": ["4 6\n", "7 7\n"],
        "hidden": ["1 1\n", "12 18\n", "17 5\n", "100 75\n", "1000000 999999\n"],
    },
    {
        "id": "matrix_transpose", "split": "test", "title": "Transpose a matrix",
        "statement": "Read R and C on the first line, then R lines of C integers. Print the C x R transpose, one row per line, numbers separated by spaces.",
        "solution": ("r, c = map(int, input().split())\nm = [input().split() for _ in range(r)]\n"
                     "for row in zip(*m):\n    print(' '.join(row))\n"),
        "public": ["2 3\n1 2 3\n4 5 6\n", "1 1\n9\n"],
        "hidden": ["3 1\n1\n2\n3\n", "1 3\n7 8 9\n", "2 2\n1 2\n3 4\n", "3 2\n1 -1\n2 -2\n3 -3\n"],
    },
    {
        "id": "balanced_brackets", "split": "test", "title": "Balanced brackets",
        "statement": "Read one line made of the characters ()[]{}. Print YES if every bracket is closed in the right order, else NO.",
        "solution": ("s = input().strip()\nst = []\npairs = {')': '(', ']': '[', '}': '{'}\nok = True\n"
                     "for ch in s:\n    if ch in '([{':\n        st.append(ch)\n"
                     "    elif not st or st.pop() != pairs[ch]:\n        ok = False\n        break\n"
                     "print('YES' if ok and not st else 'NO')\n"),
        "public": ["([]{})\n", "(]\n"],
        "hidden": ["\n", "(((\n", "{[()()]}\n", "())\n", "[{]}\n", "()[]{}\n"],
    },
    {
        "id": "second_largest", "split": "test", "title": "Second largest distinct value",
        "statement": "Read N on the first line and N integers on the second. Print the second largest distinct value, or NONE if there are fewer than two distinct values.",
        "solution": ("input()\nxs = sorted(set(map(int, input().split())))\n"
                     "print(xs[-2] if len(xs) >= 2 else 'NONE')\n"),
        "public": ["4\n1 3 3 2\n", "2\n5 5\n"],
        "hidden": ["1\n1\n", "3\n-1 -2 -3\n", "5\n9 9 8 8 7\n", "2\n0 1\n", "6\n4 4 4 4 4 3\n"],
    },
]


def run(solution: str, stdin: str) -> str:
    done = subprocess.run([sys.executable, "-I", "-S", "-c", solution], input=stdin, capture_output=True,
                          text=True, timeout=10, check=True)
    return done.stdout


def main() -> None:
    out = Path(__file__).with_name("code_problems.jsonl")
    lines = []
    for p in PROBLEMS:
        row = {
            "id": p["id"],
            "split": p["split"],
            "title": p["title"],
            "statement": p["statement"],
            "public_tests": [{"stdin": s, "stdout": run(p["solution"], s)} for s in p["public"]],
            "hidden_tests": [{"stdin": s, "stdout": run(p["solution"], s)} for s in p["hidden"]],
            "solution": p["solution"],
        }
        lines.append(json.dumps(row))
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} problems to {out}")


if __name__ == "__main__":
    main()
