import subprocess
import sys


def test_engine_and_simulator_import_without_django():
    # The MIG profile tables are plain Python that the engine, the portal and the agent share.
    code = (
        "ALLOWED = ('nodes', 'nodes.mig_profiles'); "
        "import sys; import scheduling.engine, scheduling.simulator.inflation, scheduling.simulator.replay; "
        "bad = [m for m in sys.modules if m == 'django' or m.startswith('django.') "
        "or (m.split('.')[0] in ('portal', 'nodes', 'metering') and m not in ALLOWED)]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
