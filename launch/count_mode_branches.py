"""Count the ``if``s (statements and conditional expressions) whose test names a mode, per file.

A test "names a mode" when one of its identifiers, attribute names or string constants matches one of
MODES (momentum, stage, node/hierarchy (and the node layout), exchange, sync, values, quantized (and the value codec), local steps, transactional).
Usage: ``python launch/count_mode_branches.py [package dir, default ds_dragonn] [-v]``.
"""
import ast
import pathlib
import re
import sys

MODES = re.compile(r"momentum|stage|node|hierarch|layout|codec|exchange|sync|values|quantiz|local_?steps|transactional", re.I)


def names(node):
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            yield n.id
        elif isinstance(n, ast.Attribute):
            yield n.attr
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            yield n.value


def count(root: pathlib.Path, verbose: bool = False):
    per_file = {}
    for path in sorted(root.rglob("*.py")):
        hits = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.If, ast.IfExp)):
                matched = sorted({m.group(0).lower() for s in names(node.test) for m in [MODES.search(s)] if m})
                if matched:
                    hits.append((node.lineno, matched))
        if hits:
            per_file[str(path)] = hits
    total = sum(len(h) for h in per_file.values())
    for path, hits in sorted(per_file.items(), key=lambda kv: -len(kv[1])):
        print(f"{len(hits):4d}  {path}")
        if verbose:
            for line, matched in hits:
                print(f"        {line}: {', '.join(matched)}")
    print(f"{total:4d}  in {len(per_file)} files")
    return total


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "-v"]
    count(pathlib.Path(args[0] if args else "ds_dragonn"), "-v" in sys.argv)
