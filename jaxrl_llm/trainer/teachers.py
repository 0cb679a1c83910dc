"""On-policy distillation's teachers, as a run reads them: each distinct teacher loaded
once, its tokenizer checked against the student's before any of its weights is read, and
each rollout row's teacher (teacher.field) named and its log-probs picked.

    loaded, index = load_teachers(config, algo, tokenizer, mesh)  # [(label, cfg, params)]
    rows = teacher_rows(config.teacher, index, ro)                # [n] int32, this process
    logps = jax.jit(pick_rows)(rows, *teachers_logps)             # [N, T], each row's own

`run.Run` holds what these give and dispatches the teachers' log-prob programs in its step
(`Run.teacher`); docs/teachers_and_judges.md has the settings.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxrl_llm import config as config_lib
from jaxrl_llm import models


def load_teachers(config, algo, tokenizer, mesh) -> tuple[list, dict]:
    """teacher.path and teacher.paths (on-policy distillation): each teacher's
    tokenizer must be the student's (checked before any teacher weight is read), then
    its config and params on the mesh, once per distinct path -> ([(label, cfg,
    params)], teacher name -> its index (the default teacher, teacher.path, is named
    "")); ([], {}) when algo has no distillation term."""
    teachers, teacher_index = [], {}
    if not algo.distill_coef:
        return teachers, teacher_index
    t = config.teacher
    named = ([("", "teacher.path", t.path)] if t.path else []) + [
        (name, f"teacher.paths.{name}", path) for name, path in dict(t.paths).items()
    ]
    paths = {}  # resolved path -> index
    for name, key, path in named:
        path = config_lib.resolve_model_path(path, key)
        if path not in paths:
            check_same_tokenizer(tokenizer, models.builtin.load_tokenizer(path, key), path, key)
            paths[path] = len(paths)
        teacher_index[name] = paths[path]
    for path, i in paths.items():
        cfg, params = models.builtin.load_model(path, mesh, config.model.dtype)
        teachers.append(("teacher" + (f" {i}" if i else ""), cfg, params))
    return teachers, teacher_index


def teacher_rows(t, index: dict, ro) -> np.ndarray:
    """[n] int32: the index into the teachers (`load_teachers`) of each of this
    process's rows, named by its data row's teacher.field (teacher.path where it names
    none). t: the config's teacher section; index: `load_teachers`' name -> index."""
    G = ro.out.num_generations
    examples = (
        ro.scored.examples
        if ro.scored is not None
        else [ex for ex in ro.batch.examples for _ in range(G)]
    )
    rows = []
    for ex in examples:
        value = ex.get(t.field)
        value = value if isinstance(value, str) else str(value)
        if value not in index or value == "":
            if "" not in index:
                raise config_lib.ConfigError(
                    f"teacher.field={t.field!r}: a row's value {ex.get(t.field)!r} "
                    f"names no teacher in teacher.paths ({', '.join(sorted(index))})"
                    " and teacher.path is not set"
                )
            value = ""
        rows.append(index[value])
    return np.asarray(rows, np.int32)


def pick_rows(rows, *logps):
    """Row i of logps[rows[i]]: [N] int32, K x [N, T] -> [N, T]: each row's own teacher's
    log-probs (rows: `teacher_rows`, sharded as the batch)."""
    stacked = jax.numpy.stack(logps)
    chosen = rows[None, :, None] == jax.numpy.arange(len(logps))[:, None, None]
    return jax.numpy.sum(jax.numpy.where(chosen, stacked, 0.0), axis=0)


def check_same_tokenizer(student, teacher, path: str, key: str = "teacher.path") -> None:
    """ConfigError (one line) unless the teacher's tokenizer maps every token to the
    student's id: the teacher scores the student's token ids as they are."""
    a, b = student.get_vocab(), teacher.get_vocab()
    if a == b:
        return
    differ = sum(1 for tok in a.keys() | b.keys() if a.get(tok) != b.get(tok))
    raise config_lib.ConfigError(
        f"{key}={path!r}: its tokenizer is not the student's ({len(b)} tokens "
        f"against {len(a)}, {differ} with different ids); the teacher must share the "
        "student's tokenizer"
    )
