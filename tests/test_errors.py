"""Which failures an orchestrator retries: infrastructure and the unforeseen, never the user's config or data."""

from kiln.tasks.data.executors import ExecutorError
from kiln.tasks.errors import ConfigError, InfrastructureError, InputError, KilnError, is_retryable
from kiln.tasks.launch.launchers import LaunchCancelled, LaunchError


def test_config_and_data_errors_are_not_retried():
    for error in (KilnError("x"), ConfigError("bad key"), InputError("missing file"), LaunchCancelled("stopped")):
        assert not is_retryable(error)


def test_infrastructure_failures_and_unexpected_errors_are_retried():
    for error in (InfrastructureError("node lost"), ExecutorError("rank 3 unfinished"), LaunchError("job failed"),
                  RuntimeError("a bug"), OSError("disk")):
        assert is_retryable(error)


def test_an_instance_can_say_a_retry_cannot_help():
    refused = LaunchError("sbatch: error: invalid partition specified: gpu")
    refused.retryable = False
    assert not is_retryable(refused)
    assert is_retryable(LaunchError("another job"))  # the class default is unchanged


def test_interrupts_are_not_retried():
    assert not is_retryable(KeyboardInterrupt())
