"""The code-interpreter server that runs inside a sandbox, on port 49999, for the unmodified ``e2b_code_interpreter``
SDK (``Sandbox.run_code``, ``create_code_context``, ``list_code_contexts``, ``restart_code_context``,
``remove_code_context``).

It is a self-contained package, copied into a template and run there with the guest's ``python3``::

    # this folder copied as /opt/aenv-ci/aenv_code_interpreter, its dependencies installed (see wheels.py)
    PYTHONPATH=/opt/aenv-ci python3 -m aenv_code_interpreter

It imports nothing from ``aenv_node`` (relative imports only, so it runs under any package name) and needs only the
wheels pinned in ``requirements.txt`` (``wheels.py`` fetches them on the host).  Options (flag / env var): ``--port``
``AENV_CI_PORT`` (49999), ``--host`` ``AENV_CI_HOST`` (0.0.0.0), ``--cwd`` ``AENV_CI_CWD`` (/home/user),
``--envd-url`` ``AENV_CI_ENVD_URL`` (http://127.0.0.1:49983; empty: none).  It answers ``GET /health`` once the
default Python context is up; SIGTERM stops every kernel, then the server.

What is borrowed and what is written here, and why:

* Kernels are IPython kernels (``ipykernel``) started, restarted after a crash, interrupted and stopped by
  ``jupyter_client`` (``AsyncIOLoopKernelManager``), and spoken to over the Jupyter message protocol by its async
  client: no Jupyter Server.  E2B's own template runs a Jupyter Server and talks to it over REST and WebSockets; that
  is a second HTTP server, a token, and three more hops for nothing the SDK can see.
* HTTP is Tornado, already a dependency of ipykernel and jupyter_client, so the server adds no wheel of its own
  (``starlette``+``uvicorn`` or ``aiohttp`` would add five to eight); it streams chunked NDJSON with a flush per
  line and tells when the client's connection closes.
* Written here, because no library does it: the E2B wire format (``kernels.result_line`` and the message mapping in
  ``Context._execute_user_code``: streams, MIME bundles -> ``result`` fields, errors, execution counts,
  ``end_of_execution``), which E2B defines only by its SDK and server; the routing of a kernel's iopub and shell
  messages to the request that caused them (``Context._messages``), since one execution's output must not leak
  into another's stream; one execution at a time per context, with an interrupt when the client goes away (the
  SDK's ``timeout`` closes the connection) so the next one is not stuck behind it; per-execution ``env_vars`` set
  and restored by silent helper executions, which leave no trace in the user's globals, history or execution count
  (E2B prepends code to the cell instead, shifting traceback line numbers); and the sandbox's own env vars read
  from envd's ``GET /envs`` before a kernel's first execution, as E2B does, since the server starts before a
  sandbox (and its env vars) exists.
* ``wheels.py`` exists because the VM has no network: the host downloads the pinned wheel set once per content of
  ``requirements.txt``, and the template installs it offline.

Only Python contexts are supported; another language is refused with a 400 saying so.
"""
