"""Helpers shared by the tests (imported as ``helpers.<module>``; ``tests/`` is on ``sys.path``).

* :mod:`helpers.disks`: where spill tests write (a real disk), filesystems, tmpfs mounts, filling a drive;
* :mod:`helpers.gates`: hardware gates (CUDA, root) and the engines that run here;
* :mod:`helpers.tensors`: :func:`~helpers.tensors.byte_view`;
* :mod:`helpers.models`: tiny models, one training step, bit-for-bit comparison;
* :mod:`helpers.exact`: the exactness harness (a case run plain and attached, compared);
* :mod:`helpers.llama`: a tiny Llama checkpoint, its meta skeleton and its resident model;
* :mod:`helpers.procs`: child processes of the commands, launcher environments;
* :mod:`helpers.schema`: ``gds-check``'s JSON schema;
* :mod:`helpers.imports`: the package's import graph (``tests/test_lint.py``);
* :mod:`helpers.snippets`: the code blocks of README.md and docs/ (``tests/test_docs.py``).

``tests/conftest.py`` holds the fixtures only.
"""
