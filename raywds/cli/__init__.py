"""The command line: `raywds COMMAND ...` (`raywds.cli.main:main`). Its modules stack, each
importing only those after it: `main` (the parser, and the one place where a RaywdsError becomes
exit code 1 and a one-line message), `commands` (what each command does with its typed options),
`options` (each command's options as documented dataclasses) and `flags` (a flag per field of
such a dataclass). Nothing below the command line imports it, and it imports neither torch nor
Ray until a command runs.
"""
