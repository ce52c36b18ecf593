"""Write the bundled terminal tasks (envs/data/terminal-tasks/<name>/, Harbor format).

Small offline shell tasks: files, text processing, small scripts, fixing a bug
in a tiny package. Each has an oracle (solution/solve.sh) that passes its tests
(tests/test.sh writes /logs/verifier/reward.txt); `[metadata] split` puts it in
train or test. Everything runs with bash, coreutils, grep, sed, awk, tar and
python3 (what the sandbox image agentrl/python:3.11 has). Run this file to
rewrite the folder; tests/envs/test_terminal.py checks every oracle.
"""

from __future__ import annotations

import shutil
from pathlib import Path

OUT = Path(__file__).with_name("terminal-tasks")

NUMBERS = "\n".join(str(n) for n in (12, 7, 45, 3, 28, 19, 8, 33)) + "\n"
NAMES = "mallory\nalice\ntrent\nbob\ncarol\ndave\n"
WORDS = "pear\napple\nfig\napple\nkiwi\npear\nplum\nfig\n"
LOG = "".join(f"2024-01-0{d} {lvl} request {i}\n" for i, (d, lvl) in enumerate(
    [(1, "INFO"), (1, "ERROR"), (2, "INFO"), (2, "WARN"), (3, "ERROR"), (3, "INFO"), (4, "ERROR"), (5, "INFO")]))
CSV = "name,city,age\nann,paris,31\nben,oslo,25\ncid,rome,40\ndee,lima,22\n"
TEXT = "An apple a day. The apple tree had one apple left; pineapple is not an apple.\n"

# name: (split, instruction, {app files}, extra Dockerfile RUN or None, check (bash condition), solve)
TASKS: dict[str, tuple[str, str, dict[str, str], str | None, str, str]] = {
    "hello-file": ("train", "Create the file /app/hello.txt containing exactly the line `Hello, world!`.", {}, None,
                   '[ "$(cat /app/hello.txt)" = "Hello, world!" ]', "echo 'Hello, world!' > /app/hello.txt"),
    "count-lines": ("train", "Write the number of lines of /app/data.txt (just the number) into /app/count.txt.",
                    {"data.txt": NAMES + WORDS}, None, '[ "$(tr -d " \\n" < /app/count.txt)" = 14 ]',
                    "wc -l < /app/data.txt > /app/count.txt"),
    "uppercase": ("train", "Write /app/input.txt converted to upper case into /app/output.txt.",
                  {"input.txt": "hello there\nshell tasks\n"}, None,
                  '[ "$(cat /app/output.txt)" = "$(printf "HELLO THERE\\nSHELL TASKS")" ]',
                  "tr a-z A-Z < /app/input.txt > /app/output.txt"),
    "sort-names": ("train", "Sort the lines of /app/names.txt alphabetically into /app/sorted.txt.", {"names.txt": NAMES},
                   None, 'diff <(printf "alice\\nbob\\ncarol\\ndave\\nmallory\\ntrent\\n") /app/sorted.txt',
                   "sort /app/names.txt > /app/sorted.txt"),
    "unique-words": ("train", "Write the distinct words of /app/words.txt (one per line), sorted, into /app/unique.txt.",
                     {"words.txt": WORDS}, None, 'diff <(printf "apple\\nfig\\nkiwi\\npear\\nplum\\n") /app/unique.txt',
                     "sort -u /app/words.txt > /app/unique.txt"),
    "sum-numbers": ("train", "/app/numbers.txt has one integer per line. Write their sum into /app/sum.txt.",
                    {"numbers.txt": NUMBERS}, None, '[ "$(tr -d " \\n" < /app/sum.txt)" = 155 ]',
                    "awk '{s+=$1} END {print s}' /app/numbers.txt > /app/sum.txt"),
    "max-number": ("test", "/app/numbers.txt has one integer per line. Write the largest into /app/max.txt.",
                   {"numbers.txt": NUMBERS}, None, '[ "$(tr -d " \\n" < /app/max.txt)" = 45 ]',
                   "sort -n /app/numbers.txt | tail -1 > /app/max.txt"),
    "rename-ext": ("train", "Rename every .txt file in /app/docs to the same name ending in .md.",
                   {"docs/a.txt": "a\n", "docs/b.txt": "b\n", "docs/c.txt": "c\n"}, None,
                   '[ "$(ls /app/docs | tr "\\n" " ")" = "a.md b.md c.md " ]',
                   'cd /app/docs && for f in *.txt; do mv "$f" "${f%.txt}.md"; done'),
    "make-dirs": ("train", "Create the directories /app/project/src, /app/project/tests and /app/project/docs.", {}, None,
                  "[ -d /app/project/src ] && [ -d /app/project/tests ] && [ -d /app/project/docs ]",
                  "mkdir -p /app/project/src /app/project/tests /app/project/docs"),
    "find-todo": ("test", "Write the names (not paths) of the files in /app/src that contain `TODO`, sorted, one per "
                  "line, into /app/todo.txt.", {"src/a.py": "x = 1  # TODO\n", "src/b.py": "y = 2\n",
                                                "src/c.sh": "echo hi # TODO later\n", "src/d.txt": "done\n"},
                  None, 'diff <(printf "a.py\\nc.sh\\n") /app/todo.txt',
                  "cd /app/src && grep -l TODO * | sort > /app/todo.txt"),
    "replace-word": ("train", "In /app/config.ini change the line `debug=false` to `debug=true`; keep the other lines.",
                     {"config.ini": "[app]\nname=demo\ndebug=false\nworkers=4\n"}, None,
                     'diff <(printf "[app]\\nname=demo\\ndebug=true\\nworkers=4\\n") /app/config.ini',
                     "sed -i 's/^debug=false$/debug=true/' /app/config.ini"),
    "csv-column": ("train", "Write the `city` column of /app/data.csv (without the header), one per line, into "
                   "/app/cities.txt.", {"data.csv": CSV}, None, 'diff <(printf "paris\\noslo\\nrome\\nlima\\n") /app/cities.txt',
                   "tail -n +2 /app/data.csv | cut -d, -f2 > /app/cities.txt"),
    "csv-filter": ("test", "Write the names of the people older than 30 in /app/data.csv, one per line, into "
                   "/app/older.txt.", {"data.csv": CSV}, None, 'diff <(printf "ann\\ncid\\n") /app/older.txt',
                   "awk -F, 'NR>1 && $3>30 {print $1}' /app/data.csv > /app/older.txt"),
    "make-executable": ("train", "The script /app/run.sh cannot be executed directly. Make it executable.",
                        {"run.sh": "#!/bin/bash\necho ok\n"}, None, '[ -x /app/run.sh ] && [ "$(/app/run.sh)" = ok ]',
                        "chmod +x /app/run.sh"),
    "fix-add": ("train", "The function `add` in /app/calc.py returns wrong results. Fix it.",
                {"calc.py": "def add(a: int, b: int) -> int:\n    return a - b\n"}, None,
                "cd /app && python3 -c 'from calc import add; assert add(2, 3) == 5 and add(-1, 1) == 0'",
                "sed -i 's/return a - b/return a + b/' /app/calc.py"),
    "fix-mean": ("test", "The test /app/test_stats.py fails. Fix the bug in the package /app/stats (not the test). "
                 "Run the test with `python3 /app/test_stats.py`.",
                 {"stats/__init__.py": "from .core import mean\n\n__all__ = [\"mean\"]\n",
                  "stats/core.py": "def mean(xs: list[float]) -> float:\n    return sum(xs) / (len(xs) + 1)\n",
                  "test_stats.py": "import sys\nsys.path.insert(0, '/app')\nfrom stats import mean\n"
                                   "assert mean([1, 2, 3]) == 2\nassert mean([4]) == 4\nprint('passed')\n"}, None,
                 "[ \"$(python3 /app/test_stats.py)\" = passed ] && grep -q 'assert mean(\\[4\\]) == 4' /app/test_stats.py",
                 "sed -i 's|/ (len(xs) + 1)|/ len(xs)|' /app/stats/core.py"),
    "fix-greeting": ("train", "Running `python3 /app/greet.py Ann` should print `Hello, Ann!` but does not. Fix greet.py.",
                     {"greet.py": "import sys\nprint('Hello, ' + sys.argv[0] + '!')\n"}, None,
                     '[ "$(python3 /app/greet.py Ann)" = "Hello, Ann!" ] && [ "$(python3 /app/greet.py Bo)" = "Hello, Bo!" ]',
                     "sed -i 's/sys.argv\\[0\\]/sys.argv[1]/' /app/greet.py"),
    "fizzbuzz": ("train", "Write /app/fizzbuzz.py that prints the numbers 1 to 15, one per line, but `Fizz` for "
                 "multiples of 3, `Buzz` for multiples of 5 and `FizzBuzz` for multiples of both.", {}, None,
                 'diff <(printf "1\\n2\\nFizz\\n4\\nBuzz\\nFizz\\n7\\n8\\nFizz\\nBuzz\\n11\\nFizz\\n13\\n14\\nFizzBuzz\\n") '
                 '<(python3 /app/fizzbuzz.py)',
                 "cat > /app/fizzbuzz.py <<'EOF'\nfor i in range(1, 16):\n    print('FizzBuzz' if i % 15 == 0 else "
                 "'Fizz' if i % 3 == 0 else 'Buzz' if i % 5 == 0 else i)\nEOF"),
    "is-prime": ("test", "Write /app/primes.py defining `is_prime(n)` that returns True exactly for prime numbers.", {},
                 None, "cd /app && python3 -c 'from primes import is_prime as p; "
                       "assert [n for n in range(30) if p(n)] == [2, 3, 5, 7, 11, 13, 17, 19, 23, 29]'",
                 "cat > /app/primes.py <<'EOF'\ndef is_prime(n):\n    return n > 1 and all(n % d for d in range(2, "
                 "int(n ** 0.5) + 1))\nEOF"),
    "reverse-lines": ("train", "Write the lines of /app/input.txt in reverse order into /app/reversed.txt.",
                      {"input.txt": "one\ntwo\nthree\nfour\n"}, None,
                      'diff <(printf "four\\nthree\\ntwo\\none\\n") /app/reversed.txt', "tac /app/input.txt > /app/reversed.txt"),
    "count-word": ("test", "Count how many times the word `apple` (as a whole word) occurs in /app/text.txt and write "
                   "the number into /app/apples.txt.", {"text.txt": TEXT}, None,
                   '[ "$(tr -d " \\n" < /app/apples.txt)" = 4 ]', "grep -ow apple /app/text.txt | wc -l > /app/apples.txt"),
    "largest-file": ("train", "Write the name of the largest file in /app/files into /app/largest.txt.",
                     {"files/small.txt": "x\n", "files/big.txt": "x" * 500 + "\n", "files/mid.txt": "x" * 50 + "\n"},
                     None, '[ "$(tr -d " \\n" < /app/largest.txt)" = big.txt ]',
                     "ls -S /app/files | head -1 > /app/largest.txt"),
    "greet-script": ("train", "Write an executable script /app/greet.sh that prints `Hello, NAME` where NAME is the "
                     "value of the environment variable NAME.", {}, None,
                     '[ "$(NAME=Zed /app/greet.sh)" = "Hello, Zed" ]',
                     "printf '#!/bin/bash\\necho \"Hello, $NAME\"\\n' > /app/greet.sh && chmod +x /app/greet.sh"),
    "make-archive": ("train", "Create the gzip-compressed tar archive /app/backup.tar.gz of the directory /app/data "
                     "(the archive must contain data/...).", {"data/a.txt": "a\n", "data/sub/b.txt": "b\n"}, None,
                     "tar tzf /app/backup.tar.gz | grep -q '^data/sub/b.txt$'",
                     "cd /app && tar czf backup.tar.gz data"),
    "extract-archive": ("test", "Extract the archive /app/bundle.tar.gz into the directory /app/out.",
                        {"src/readme.txt": "inside\n"}, "cd /app && tar czf bundle.tar.gz -C src readme.txt && rm -r src",
                        '[ "$(cat /app/out/readme.txt)" = inside ]',
                        "mkdir -p /app/out && tar xzf /app/bundle.tar.gz -C /app/out"),
    "head-lines": ("train", "Write the first 3 lines of /app/app.log into /app/head.txt.", {"app.log": LOG}, None,
                   'diff <(head -3 /app/app.log) /app/head.txt', "head -3 /app/app.log > /app/head.txt"),
    "grep-errors": ("train", "Write every line of /app/app.log that contains `ERROR` into /app/errors.txt.",
                    {"app.log": LOG}, None, '[ "$(wc -l < /app/errors.txt)" = 3 ] && ! grep -qv ERROR /app/errors.txt',
                    "grep ERROR /app/app.log > /app/errors.txt"),
    "count-py-files": ("test", "Write the number of `.py` files anywhere under /app/src into /app/count.txt.",
                       {"src/a.py": "", "src/pkg/b.py": "", "src/pkg/c.txt": "", "src/pkg/deep/d.py": ""}, None,
                       '[ "$(tr -d " \\n" < /app/count.txt)" = 3 ]',
                       "find /app/src -name '*.py' | wc -l > /app/count.txt"),
    "symlink-latest": ("train", "Create a symbolic link /app/latest that points to /app/releases/v2.",
                       {"releases/v1/VERSION": "1\n", "releases/v2/VERSION": "2\n"}, None,
                       '[ -L /app/latest ] && [ "$(cat /app/latest/VERSION)" = 2 ]',
                       "ln -s /app/releases/v2 /app/latest"),
    "private-file": ("train", "Make /app/secret.txt readable and writable by its owner only (mode 600).",
                     {"secret.txt": "s3cret\n"}, None, '[ "$(stat -c %a /app/secret.txt)" = 600 ]',
                     "chmod 600 /app/secret.txt"),
    "dedupe-lines": ("test", "Write the lines of /app/words.txt without duplicates, keeping the first occurrence and "
                     "the original order, into /app/dedup.txt.", {"words.txt": WORDS}, None,
                     'diff <(printf "pear\\napple\\nfig\\nkiwi\\nplum\\n") /app/dedup.txt',
                     "awk '!seen[$0]++' /app/words.txt > /app/dedup.txt"),
    "join-parts": ("train", "Concatenate /app/part1.txt, /app/part2.txt and /app/part3.txt, in that order, into "
                   "/app/full.txt.", {"part1.txt": "alpha\n", "part2.txt": "beta\n", "part3.txt": "gamma\n"}, None,
                   'diff <(printf "alpha\\nbeta\\ngamma\\n") /app/full.txt',
                   "cat /app/part1.txt /app/part2.txt /app/part3.txt > /app/full.txt"),
    "change-port": ("test", "The server in /app/server.conf must listen on port 9090 instead of 8080. Change only the "
                    "port.", {"server.conf": "host=0.0.0.0\nport=8080\nlog=/var/log/s.log\n"}, None,
                    'diff <(printf "host=0.0.0.0\\nport=9090\\nlog=/var/log/s.log\\n") /app/server.conf',
                    "sed -i 's/^port=8080$/port=9090/' /app/server.conf"),
    "lowercase-names": ("train", "Rename every file in /app/in to its name in lower case.",
                        {"in/README.TXT": "r\n", "in/Data.CSV": "d\n", "in/notes.md": "n\n"}, None,
                        '[ "$(ls /app/in | tr "\\n" " ")" = "data.csv notes.md readme.txt " ]',
                        'cd /app/in && for f in *; do l=$(echo "$f" | tr A-Z a-z); [ "$f" = "$l" ] || mv "$f" "$l"; done'),
}


def dockerfile(has_files: bool, run: str | None) -> str:
    lines = ["FROM agentrl/python:3.11", "WORKDIR /app"]
    if has_files:
        lines.append("COPY app/ /app/")
    if run:
        lines.append(f"RUN {run}")
    return "\n".join(lines) + "\n"


def test_sh(check: str) -> str:
    return ("#!/bin/bash\n# Writes 1 to the reward file when the task is done, else 0.\nmkdir -p /logs/verifier\n"
            f"if {check}; then\n  echo 1 > /logs/verifier/reward.txt\nelse\n  echo 0 > /logs/verifier/reward.txt\nfi\n")


def task_toml(name: str, split: str) -> str:
    return (f'version = "1.0"\n\n[metadata]\nauthor_name = "agentrl"\ndifficulty = "easy"\ncategory = "terminal"\n'
            f'split = "{split}"\n\n[verifier]\ntimeout_sec = 60.0\n\n[agent]\ntimeout_sec = 300.0\n\n'
            f'[environment]\nbuild_timeout_sec = 300.0\ncpus = 1\nmemory_mb = 512\n')


def main() -> None:
    if OUT.exists():
        shutil.rmtree(OUT)
    for name, (split, instruction, files, run, check, solve) in TASKS.items():
        d = OUT / name
        for sub in ("environment", "tests", "solution"):
            (d / sub).mkdir(parents=True)
        (d / "task.toml").write_text(task_toml(name, split))
        (d / "instruction.md").write_text(instruction + "\n")
        (d / "environment" / "Dockerfile").write_text(dockerfile(bool(files), run))
        for rel, content in files.items():
            p = d / "environment" / "app" / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(content)
        (d / "tests" / "test.sh").write_text(test_sh(check))
        (d / "solution" / "solve.sh").write_text(f"#!/bin/bash\nset -e\n{solve}\n")


if __name__ == "__main__":
    main()
