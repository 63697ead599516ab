"""Drives the real OpenSandbox Python SDK (opensandbox==1.1.1), unchanged, against Berth's
OpenSandbox surface: create by image (a template's name, and an OCI image in a registry,
pulled on first use; an unknown image is a clean SDK exception) and by template, commands (output, exit codes, a long
run, argv, background), files (write, read, a missing file), pause and resume (a process that
keeps running on gVisor), renew, get_info, list with filters, kill.

Run by `tests/ops/compat.rs` with OPEN_SANDBOX_DOMAIN (`host:port/compat/opensandbox`),
OPEN_SANDBOX_API_KEY (a Berth key), BERTH_RUN (a unique metadata value), BERTH_OCI_IMAGE (an
image in a local registry whose /etc/berth-mark holds BERTH_OCI_MARK) and BERTH_OCI_MISSING (a
reference to an image that registry does not have). Any exception,
from the SDK or an assertion, fails it (exit status 1 and a traceback); it prints `ok` at the
end.
"""

import asyncio
import os
import time
from datetime import datetime, timedelta, timezone

from opensandbox import Sandbox, SandboxManager
from opensandbox.config import ConnectionConfig
from opensandbox.exceptions import SandboxApiException
from opensandbox.models.execd import ExecutionHandlers, RunCommandOpts
from opensandbox.models.sandboxes import SandboxFilter

# Generous: a loaded 2-core machine boots sandboxes slowly.
READY = timedelta(seconds=240)
SETTLE_SECONDS = 240

CONFIG = ConnectionConfig(
    domain=os.environ["OPEN_SANDBOX_DOMAIN"],
    api_key=os.environ["OPEN_SANDBOX_API_KEY"],
    request_timeout=timedelta(seconds=120),
)
RUN = os.environ["BERTH_RUN"]
OCI_IMAGE = os.environ["BERTH_OCI_IMAGE"]
OCI_MARK = os.environ["BERTH_OCI_MARK"]
OCI_MISSING = os.environ["BERTH_OCI_MISSING"]


def stdout_of(execution):
    return [m.text for m in execution.logs.stdout]


def stderr_of(execution):
    return [m.text for m in execution.logs.stderr]


async def shell(sandbox, text):
    execution = await sandbox.commands.run(text)
    assert execution.exit_code == 0, (text, execution)
    return "\n".join(stdout_of(execution))


async def until_state(manager, sandbox_id, state):
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        info = await manager.get_sandbox_info(sandbox_id)
        if info.status.state == state:
            return info
        assert time.monotonic() < deadline, f"{sandbox_id} never {state}: {info.status}"
        await asyncio.sleep(0.5)


async def listed(manager, **filter_args):
    page = await manager.list_sandbox_infos(SandboxFilter(**filter_args))
    return {info.id for info in page.sandbox_infos}, page.pagination


async def by_image(manager):
    sandbox = await Sandbox.create(
        "base",
        connection_config=CONFIG,
        timeout=timedelta(minutes=10),
        ready_timeout=READY,
        env={"GREETING": "hello from env"},
        metadata={"run": RUN, "kind": "image"},
        resource={"cpu": "1", "memory": "256Mi"},
        entrypoint=["sh", "-c", "echo started > /tmp/entrypoint-ran; exec sleep 100000"],
    )
    info = await sandbox.get_info()
    assert info.status.state == "Running", info.status
    assert info.image.image == "base", info.image
    assert info.metadata == {"run": RUN, "kind": "image"}, info.metadata
    assert info.entrypoint[0] == "sh", info.entrypoint
    assert info.expires_at is not None and info.expires_at > datetime.now(timezone.utc)

    # Output, one event per line; the sandbox's env reaches every command.
    execution = await sandbox.commands.run("echo one; echo two >&2; echo $GREETING; printf x")
    assert execution.exit_code == 0, execution
    assert stdout_of(execution) == ["one", "hello from env", "x"], stdout_of(execution)
    assert stderr_of(execution) == ["two"], stderr_of(execution)
    # A command's own env wins over the sandbox's.
    execution = await sandbox.commands.run(
        "echo $GREETING", opts=RunCommandOpts(envs={"GREETING": "mine"})
    )
    assert stdout_of(execution) == ["mine"], stdout_of(execution)
    # Exit codes: a non-zero exit is an error event carrying it.
    execution = await sandbox.commands.run("echo before; exit 3")
    assert execution.exit_code == 3, execution
    assert execution.error is not None and execution.error.value == "3", execution.error
    assert stdout_of(execution) == ["before"]
    execution = await sandbox.commands.run(["no-such-program"])
    assert execution.exit_code == 127, execution
    # argv runs without a shell.
    execution = await sandbox.commands.run(["echo", "a  b", "$HOME"])
    assert stdout_of(execution) == ["a  b $HOME"], stdout_of(execution)
    # A long run streams its lines as they come (and outlives the 3 s ping interval): when
    # its first line arrives, the command has not finished yet.
    seen, finished_at_first_line = [], []

    async def on_stdout(message):
        seen.append(message.text)
        if len(seen) == 1:
            probe = await sandbox.commands.run("test -e /tmp/ticks-done")
            finished_at_first_line.append(probe.exit_code == 0)

    execution = await sandbox.commands.run(
        "for i in 1 2 3 4 5 6 7 8; do echo tick $i; sleep 1; done; touch /tmp/ticks-done",
        handlers=ExecutionHandlers(on_stdout=on_stdout),
    )
    assert execution.exit_code == 0, execution
    assert seen == [f"tick {i}" for i in range(1, 9)], seen
    assert finished_at_first_line == [False], "the first line came only after the end"
    # The entrypoint was started at boot, in the background.
    assert (await shell(sandbox, "cat /tmp/entrypoint-ran")) == "started"
    assert "sleep 100000" in await shell(sandbox, "ps")

    # Files: write (mode applied), read back, binary, a missing file.
    await sandbox.files.write_file("/tmp/dir/hello.txt", "hi there\n", mode=640)
    assert await sandbox.files.read_file("/tmp/dir/hello.txt") == "hi there\n"
    assert (await shell(sandbox, "stat -c %a /tmp/dir/hello.txt")) == "640"
    blob = os.urandom(300 * 1024)
    await sandbox.files.write_file("/tmp/blob.bin", blob)
    assert await sandbox.files.read_bytes("/tmp/blob.bin") == blob
    try:
        await sandbox.files.read_file("/tmp/no-such-file")
    except SandboxApiException as e:
        assert e.status_code == 404, e
    else:
        raise AssertionError("reading a missing file succeeded")

    # Renew.
    renewed = await sandbox.renew(timedelta(minutes=30))
    assert renewed.expires_at > datetime.now(timezone.utc) + timedelta(minutes=25), renewed
    info = await sandbox.get_info()
    assert abs((info.expires_at - renewed.expires_at).total_seconds()) < 1, info.expires_at
    return sandbox


async def create_pulled(image, **kwargs):
    """Sandbox.create by an OCI image. Berth answers a create whose image is still being
    pulled past its bounded wait with 409 template_not_ready; a client creates again."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        try:
            return await Sandbox.create(image, **kwargs)
        except SandboxApiException as e:
            if e.error.code != "template_not_ready" or time.monotonic() > deadline:
                raise
            await asyncio.sleep(1)


async def by_oci_image(manager):
    """An OCI image in a registry, pulled into a template on first use; a command in it reads
    a file of the image. An unknown image is a clean SandboxApiException with Berth's code."""
    sandbox = await create_pulled(
        OCI_IMAGE,
        connection_config=CONFIG,
        timeout=timedelta(minutes=10),
        ready_timeout=READY,
        metadata={"run": RUN + "-oci"},
        resource={"cpu": "1", "memory": "256Mi"},
    )
    info = await sandbox.get_info()
    assert info.status.state == "Running", info.status
    assert info.image.image == OCI_IMAGE, info.image
    assert (await shell(sandbox, "cat /etc/berth-mark")) == OCI_MARK
    execution = await sandbox.commands.run("echo from the image; exit 4")
    assert execution.exit_code == 4 and stdout_of(execution) == ["from the image"], execution
    await sandbox.kill()
    await until_state(manager, sandbox.id, "Terminated")
    await sandbox.close()
    try:
        await create_pulled(
            OCI_MISSING,
            connection_config=CONFIG,
            timeout=timedelta(minutes=10),
            ready_timeout=READY,
            metadata={"run": RUN + "-missing"},
        )
    except SandboxApiException as e:
        assert (e.status_code, e.error.code) == (400, "unknown_image"), (e.status_code, e.error)
        assert OCI_MISSING in e.error.message, e.error.message
    else:
        raise AssertionError("a create by an unknown image succeeded")
    ids, _ = await listed(manager, metadata={"run": RUN + "-missing"})
    assert ids == set(), ids


async def by_template(manager):
    sandbox = await Sandbox.create_from_template(
        "base-gvisor",
        timeout=timedelta(minutes=10),
        connection_config=CONFIG,
        ready_timeout=READY,
        metadata={"run": RUN, "kind": "template"},
    )
    info = await sandbox.get_info()
    assert info.status.state == "Running", info.status
    # A background counter: the command answers at once, the process keeps running.
    execution = await sandbox.commands.run(
        # (written beside and renamed over, so a read never finds the file truncated mid-write)
        "echo $$ > /tmp/pid; i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new;"
        " mv /tmp/count.new /tmp/count; sleep 0.2; done",
        opts=RunCommandOpts(background=True),
    )
    # (the SDK leaves a background run's exit_code unset)
    assert execution.complete is not None and execution.error is None, execution
    deadline = time.monotonic() + 60
    while not (await sandbox.commands.run("test -s /tmp/count")).exit_code == 0:
        assert time.monotonic() < deadline, "the background counter never wrote"
        await asyncio.sleep(0.2)
    pid = await shell(sandbox, "cat /tmp/pid")
    before = int(await shell(sandbox, "cat /tmp/count"))
    return sandbox, pid, before


async def main():
    manager = await SandboxManager.create(connection_config=CONFIG)
    await by_oci_image(manager)
    image = await by_image(manager)
    template, pid, before = await by_template(manager)

    # List with filters: by metadata, by state, and both.
    ids, pagination = await listed(manager, metadata={"run": RUN})
    assert {image.id, template.id} <= ids, ids
    assert pagination.total_items == 2, pagination
    ids, _ = await listed(manager, metadata={"run": RUN, "kind": "image"})
    assert ids == {image.id}, ids
    ids, pagination = await listed(manager, metadata={"run": RUN}, page_size=1, page=2)
    assert len(ids) == 1 and pagination.total_pages == 2, pagination
    assert not pagination.has_next_page, pagination

    # Pause the gVisor sandbox (Berth's stop keeps its memory) and resume it.
    await template.pause()
    await until_state(manager, template.id, "Paused")
    ids, _ = await listed(manager, states=["Paused"], metadata={"run": RUN})
    assert ids == {template.id}, ids
    ids, _ = await listed(manager, states=["Running", "Pending"], metadata={"run": RUN})
    assert ids == {image.id}, ids
    resumed = await Sandbox.resume(template.id, connection_config=CONFIG, resume_timeout=READY)
    info = await resumed.get_info()
    assert info.status.state == "Running", info.status
    # The counter continues: the same process, still counting.
    assert (await resumed.commands.run(f"kill -0 {pid}")).exit_code == 0, "the process is gone"
    after = int(await shell(resumed, "cat /tmp/count"))
    assert after >= before, (before, after)
    deadline = time.monotonic() + 30
    while int(await shell(resumed, "cat /tmp/count")) <= after:
        assert time.monotonic() < deadline, "the counter stopped after the resume"
        await asyncio.sleep(0.3)

    # Kill both: they end Terminated.
    await image.kill()
    await resumed.kill()
    await until_state(manager, image.id, "Terminated")
    await until_state(manager, template.id, "Terminated")
    ids, _ = await listed(manager, metadata={"run": RUN})
    assert ids == set(), ids
    ids, _ = await listed(manager, states=["Terminated"], metadata={"run": RUN})
    assert ids == {image.id, template.id}, ids

    for sandbox in (image, template, resumed):
        await sandbox.close()
    await manager.close()
    print("ok")


if __name__ == "__main__":
    asyncio.run(main())
