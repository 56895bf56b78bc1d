"""Wrong implementations of chapter 09 that the grader must fail (see labkit.course.mutants)."""

from labkit.course.mutants import Mutant

_SAVE_BODY = '''    rank, world = dist.get_rank(), dist.get_world_size()
    final = checkpoint_dir(root, step)
    staging = final.with_name(final.name + ".partial")
'''

_SAVE_RENAME = '''        (staging / (METADATA + ".tmp")).write_text(json.dumps(metadata))
        os.replace(staging / (METADATA + ".tmp"), staging / METADATA)
        _maybe_crash(crash_at, "rename", rank)
        replaced = final.with_name(final.name + ".replaced")
        if final.exists():  # an older save of this very step: keep it until the new one is in place
            os.rename(final, replaced)
        os.rename(staging, final)  # the one atomic step: from here on the checkpoint exists
'''

_METADATA_CRASH = '        _maybe_crash(crash_at, "metadata", rank)\n'

_SAVE_METADATA = _METADATA_CRASH + """        tensors: dict = {}
        for file, _, pieces in gathered:
            for key, (shape, start, rows) in pieces.items():
                tensors.setdefault(key, dict(shape=shape, pieces=[]))["pieces"].append([file, start, rows])
        metadata = dict(step=step, world_size=world, files={file: digest for file, digest, _ in gathered},
                        tensors=tensors)
        (staging / (METADATA + ".tmp")).write_text(json.dumps(metadata))
        os.replace(staging / (METADATA + ".tmp"), staging / METADATA)
"""

MUTANTS = [
    # elastic.state
    Mutant("elastic.state", "losses_aliased",
           "vars(progress) is already a dict: the state keeps the run's own loss list, which keeps growing",
           find="progress=dict(vars(progress), losses=list(progress.losses)),",
           replace="progress=dict(vars(progress)),"),
    Mutant("elastic.state", "python_rng_not_restored", "restores torch's RNG and forgets Python's random",
           find='    random.setstate(state["rng"]["python"])\n',
           replace=''),
    Mutant("elastic.state", "restored_losses_shared",
           "the restored progress is built from the state's dict as it is: the resumed run appends its "
           "losses to the state's own list, and restoring that state again brings them back",
           find='Progress(**dict(state["progress"], losses=list(state["progress"]["losses"])))',
           replace='Progress(**state["progress"])'),
    Mutant("elastic.state", "adam_moments_only",
           "keeps the optimizer state a checkpoint usually has (Adam's step and two moments) by name: "
           "SGD's momentum buffer and AMSGrad's running maximum are not captured",
           find="return dict(model=model_pieces(model), optimizer=optimizer_pieces(optimizer, model),",
           replace="return dict(model=model_pieces(model), optimizer={name: piece for name, piece in "
                   "optimizer_pieces(optimizer, model).items() if name.rsplit('::', 1)[1] in ('step', 'exp_avg', 'exp_avg_sq')},"),
    Mutant("elastic.state", "torch_rng_not_captured",
           "captures only Python's RNG state (the GPT has no dropout, so why torch's?)",
           find='rng=dict(torch=torch.get_rng_state(), python=random.getstate()))',
           replace='rng=dict(python=random.getstate()))'),
    Mutant("elastic.state", "optimizer_not_captured",
           "the state is the model's pieces: Adam's moments start again after a restore",
           find="return dict(model=model_pieces(model), optimizer=optimizer_pieces(optimizer, model),",
           replace="return dict(model=model_pieces(model), optimizer={},"),
    # elastic.save
    Mutant("elastic.save", "keeps_crashed_staging",
           "writes into a crashed save's leftover staging directory without clearing it first",
           find="    if rank == 0 and staging.exists():\n        shutil.rmtree(staging)",
           replace="    if False:\n        shutil.rmtree(staging)"),
    Mutant("elastic.save", "keeps_two",
           "prunes to the two newest, the usual setting, whatever keep says",
           find="for old in sorted(_step_dirs(root))[:-keep]:",
           replace="for old in sorted(_step_dirs(root))[:-2]:"),
    Mutant("elastic.save", "returns_the_staging_dir",
           "returns the directory it wrote into",
           find="    dist.barrier()\n    return final\n",
           replace="    dist.barrier()\n    return staging\n"),
    Mutant("elastic.save", "in_place",
           "written in place: no staging directory, no temp file, no rename (the metadata comes last anyway)",
           find=_SAVE_BODY + '''    if rank == 0 and staging.exists():''',
           replace='''    rank, world = dist.get_rank(), dist.get_world_size()
    final = checkpoint_dir(root, step)
    final.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    name = f"rank{rank}.pt"
    torch.save(state, final / name)
    index = {key: (list(piece.shape), piece.start, len(piece.tensor) if piece.tensor.dim() else 0)
             for section in ("model", "optimizer") for key, piece in
             ((f"{section}/{k}", v) for k, v in state[section].items())}
    gathered = [None] * world if rank == 0 else None
    dist.gather_object((name, file_digest(final / name), index), gathered, dst=0)
    if rank == 0:
        tensors = {}
        for file, _, pieces in gathered:
            for key, (shape, start, rows) in pieces.items():
                tensors.setdefault(key, dict(shape=shape, pieces=[]))["pieces"].append([file, start, rows])
        metadata = dict(step=step, world_size=world, files={file: digest for file, digest, _ in gathered},
                        tensors=tensors)
        (final / METADATA).write_text(json.dumps(metadata))
        for old in sorted(_step_dirs(root))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final
    staging = final
    if rank == 0 and staging.exists():'''),
    Mutant("elastic.save", "tmp_files_in_place",
           "every file through a .tmp and os.replace, straight into step_<n>/: each file is atomic, so is the save",
           find=_SAVE_BODY + '''    if rank == 0 and staging.exists():''',
           replace='''    rank, world = dist.get_rank(), dist.get_world_size()
    final = checkpoint_dir(root, step)
    final.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    name = f"rank{rank}.pt"
    torch.save(state, final / (name + ".tmp"))
    os.replace(final / (name + ".tmp"), final / name)
    index = {key: (list(piece.shape), piece.start, len(piece.tensor) if piece.tensor.dim() else 0)
             for section in ("model", "optimizer") for key, piece in
             ((f"{section}/{k}", v) for k, v in state[section].items())}
    gathered = [None] * world if rank == 0 else None
    dist.gather_object((name, file_digest(final / name), index), gathered, dst=0)
    if rank == 0:
        tensors = {}
        for file, _, pieces in gathered:
            for key, (shape, start, rows) in pieces.items():
                tensors.setdefault(key, dict(shape=shape, pieces=[]))["pieces"].append([file, start, rows])
        metadata = dict(step=step, world_size=world, files={file: digest for file, digest, _ in gathered},
                        tensors=tensors)
        (final / (METADATA + ".tmp")).write_text(json.dumps(metadata))
        os.replace(final / (METADATA + ".tmp"), final / METADATA)
        for old in sorted(_step_dirs(root))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final
    staging = final
    if rank == 0 and staging.exists():'''),
    Mutant("elastic.save", "files_moved_one_by_one",
           "each file goes into step_<n>/ with os.replace, which is atomic: no directory rename needed",
           find="        os.rename(staging, final)  # the one atomic step: from here on the checkpoint exists",
           replace="        final.mkdir()\n"
                   "        for file in sorted(staging.iterdir()):\n"
                   "            os.replace(file, final / file.name)\n"
                   "        staging.rmdir()"),
    Mutant("elastic.save", "crash_at_ignored_when_writing", "never calls _maybe_crash before writing its file: "
           "crash_at='write' saves as if nothing were asked",
           find='    _maybe_crash(crash_at, "write", rank, staging / (name + ".tmp"))\n', replace=""),
    Mutant("elastic.save", "metadata_crash_after_the_metadata", "crashes for 'metadata' after writing metadata.json, "
           "not before: the lab's crash leaves another directory than the one it describes",
           find=_SAVE_METADATA, replace=_SAVE_METADATA.removeprefix(_METADATA_CRASH) + _METADATA_CRASH),
    Mutant("elastic.save", "copied_not_renamed", "copies the staging directory into place, then deletes it",
           find="        os.rename(staging, final)  # the one atomic step: from here on the checkpoint exists",
           replace="        shutil.copytree(staging, final)\n        shutil.rmtree(staging)"),
    Mutant("elastic.save", "metadata_after_rename",
           "renames the rank files into place first and writes metadata.json into the checkpoint last",
           find=_SAVE_RENAME,
           replace='''        _maybe_crash(crash_at, "rename", rank)
        replaced = final.with_name(final.name + ".replaced")
        if final.exists():  # an older save of this very step: keep it until the new one is in place
            os.rename(final, replaced)
        os.rename(staging, final)
        (final / (METADATA + ".tmp")).write_text(json.dumps(metadata))
        os.replace(final / (METADATA + ".tmp"), final / METADATA)
'''),
    Mutant("elastic.save", "prunes_the_newest", "keeps the first `keep` checkpoints: deletes the one just written",
           find="for old in sorted(_step_dirs(root))[:-keep]:", replace="for old in sorted(_step_dirs(root))[keep:]:"),
    Mutant("elastic.save", "all_gather_object",
           "every rank gathers every digest (all_gather_object), only rank 0 needs them",
           find="    gathered = [None] * world if rank == 0 else None\n"
                "    dist.gather_object((name, file_digest(staging / name), index), gathered, dst=0)",
           replace="    gathered = [None] * world\n"
                   "    dist.all_gather_object(gathered, (name, file_digest(staging / name), index))"),
    Mutant("elastic.save", "files_sent_to_rank0",
           "sends its file's bytes along with the digest, so that rank 0 can check every file itself",
           find="    gathered = [None] * world if rank == 0 else None\n"
                "    dist.gather_object((name, file_digest(staging / name), index), gathered, dst=0)\n",
           replace="    blob = (staging / name).read_bytes()\n"
                   "    gathered = [None] * world if rank == 0 else None\n"
                   "    dist.gather_object((name, file_digest(staging / name), index, blob), gathered, dst=0)\n"
                   "    if rank == 0:\n"
                   "        gathered = [g[:3] for g in gathered if hashlib.sha256(g[3]).hexdigest() == g[1][\"sha256\"]]\n"),
    Mutant("elastic.save", "broadcasts_the_path",
           "one collective too many: rank 0 tells everyone where the checkpoint is",
           find="    dist.barrier()\n    return final\n",
           replace="    where = [str(final)]\n    dist.broadcast_object_list(where, src=0)\n"
                   "    dist.barrier()\n    return Path(where[0])\n"),
    Mutant("elastic.save", "no_final_barrier", "returns as soon as its own file is written: rank 0 finishes alone",
           find="    dist.barrier()\n    return final\n", replace="    return final\n"),
    Mutant("elastic.save", "builtin_dcp", "torch.distributed.checkpoint.save does it all",
           find=_SAVE_BODY,
           replace='''    import torch.distributed.checkpoint as dcp
    dcp.save({"state": state}, checkpoint_id=str(checkpoint_dir(root, step)))
    return checkpoint_dir(root, step)
''' + _SAVE_BODY),
    # elastic.load
    Mutant("elastic.load", "no_digest_check", "checks that every file exists, not what it holds",
           find="        found = file_digest(path / file)\n", replace="        found = digest\n"),
    Mutant("elastic.load", "glob_includes_partial", "takes the newest step_* directory, .partial or not",
           find="    for path in sorted(_step_dirs(root), reverse=True):",
           replace='    for path in sorted(Path(root).glob("step_*"), reverse=True):'),
    Mutant("elastic.load", "oldest_first", "sorted() without reverse: the oldest valid checkpoint comes first",
           find="    for path in sorted(_step_dirs(root), reverse=True):",
           replace="    for path in sorted(_step_dirs(root)):"),
    Mutant("elastic.load", "no_shape_check", "trusts the checkpoint's shapes: it is ours anyway",
           find='''        if tuple(entry["shape"]) != tuple(shape):
            raise CheckpointError(''',
           replace='''        if False:
            raise CheckpointError('''),
    Mutant("elastic.load", "piece_start_ignored",
           "takes rows from the top of each piece, forgetting the piece starts at its own first row",
           find="parts.append(read(file)[section][name].tensor[lo - first:hi - first])",
           replace="parts.append(read(file)[section][name].tensor[:hi - lo])"),
    Mutant("elastic.load", "optimizer_not_loaded", "loads the model; the optimizer starts afresh",
           find="    put_optimizer_rows(optimizer, model, optimizer_rows)\n", replace=""),
    Mutant("elastic.load", "builtin_dcp", "torch.distributed.checkpoint.load in place of reading the rows",
           find="    path = Path(path)\n    metadata = validate_checkpoint(path)\n    files: dict",
           replace="    import torch.distributed.checkpoint as dcp\n"
                   "    dcp.load({\"model\": model.state_dict()}, checkpoint_id=str(path))\n"
                   "    path = Path(path)\n    metadata = validate_checkpoint(path)\n    files: dict"),
    # elastic.resume
    Mutant("elastic.resume", "restarts_from_step_0", "loads the checkpoint, then trains every step again",
           find="    for step in range(progress.step, job.steps):", replace="    for step in range(job.steps):"),
    Mutant("elastic.resume", "oldest_checkpoint",
           "resumes from the first checkpoint it finds: still exact, just slower",
           find="    latest = latest_checkpoint(job.root)\n",
           replace="    latest = min(_step_dirs(job.root), default=None)\n"),
    Mutant("elastic.resume", "position_not_advanced", "advances the step, forgets the data position",
           find="progress.step, progress.position = step + 1, progress.position + job.samples_per_step",
           replace="progress.step = step + 1"),
    Mutant("elastic.resume", "no_save_at_the_end", "saves every save_every steps only: the last steps are lost",
           find="if progress.step % job.save_every == 0 or progress.step == job.steps:",
           replace="if progress.step % job.save_every == 0:"),
    Mutant("elastic.resume", "saves_every_step", "saves after every step, to lose nothing",
           find="if progress.step % job.save_every == 0 or progress.step == job.steps:",
           replace="if True:"),
    # Issue 39: param-group options are state (an LR schedule changes them)
    Mutant("elastic.state", "drops_group_options",
           "captures the optimizer's moments but not its param groups' options: restore keeps today's lr",
           find="    put_group_options(optimizer, state[\"groups\"])\n",
           replace=""),
    Mutant("elastic.load", "load_drops_group_options",
           "loads every tensor but leaves the fresh optimizer's options (the constructor's lr, not the schedule's)",
           find="    put_group_options(optimizer, mine[\"groups\"])  # the same on every rank\n",
           replace=""),
]
