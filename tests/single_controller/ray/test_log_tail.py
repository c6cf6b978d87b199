"""`WorkerLogTail` prints what Ray's log monitor would: each worker file's new lines once, prefixed with the actor
name and pid its markers give, `.err` files to stderr, Ray's marker lines never, a last unfinished line at `stop()`,
and a truncated (rotated) file from its start. Plain files, no Ray."""

from verl.single_controller.ray.log_tail import WorkerLogTail

WORKER = "worker-3f2a-01000000-4242"


def _append(path, text):
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)


def test_new_lines_are_printed_once_with_rays_prefix(tmp_path, capsys):
    out, err = tmp_path / f"{WORKER}.out", tmp_path / f"{WORKER}.err"
    _append(out, ":job_id:01000000\n:actor_name:FusedWorker_actor_rollout_ref\nloading weights\nhalf a li")
    _append(err, ":job_id:01000000\n:actor_name:FusedWorker_actor_rollout_ref\nWarning: slow\n")
    _append(tmp_path / "raylet.err", "worker 4242 killed: out of memory\n")
    _append(tmp_path / "raylet.out", "raylet's own chatter is not printed\n")
    tail = WorkerLogTail(str(tmp_path))
    tail.poll()
    printed = capsys.readouterr()
    assert printed.out.splitlines() == ["(FusedWorker_actor_rollout_ref pid=4242) loading weights"]
    assert printed.err.splitlines() == [
        "(raylet) worker 4242 killed: out of memory",
        "(FusedWorker_actor_rollout_ref pid=4242) Warning: slow",
    ]

    tail.poll()  # nothing new: nothing printed again
    assert capsys.readouterr().out == ""
    _append(out, "ne\n")
    _append(tmp_path / "worker-77aa-01000000-4343.out", ":job_id:01000000\n:task_name:score_batch\nscored 8\n")
    tail.poll()
    assert capsys.readouterr().out.splitlines() == [
        "(FusedWorker_actor_rollout_ref pid=4242) half a line",
        "(score_batch pid=4343) scored 8",
    ]


def test_stop_prints_the_unfinished_line_and_a_truncated_file_is_read_again(tmp_path, capsys):
    out = tmp_path / "worker-9c-02000000-7.out"
    _append(out, "a first line, longer than what replaces it\n")
    tail = WorkerLogTail(str(tmp_path), interval_s=0.01).start()
    tail.stop()
    assert capsys.readouterr().out.splitlines() == ["(pid=7) a first line, longer than what replaces it"]
    out.write_text("again\nlast without newline", encoding="utf-8")  # shorter than what was read: rotated
    tail.poll(final=True)
    assert capsys.readouterr().out.splitlines() == ["(pid=7) again", "(pid=7) last without newline"]
