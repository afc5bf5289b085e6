"""A real S3 server for the tests: moto's server mode in its own process on 127.0.0.1, a free port.

Requests are authenticated (``INITIAL_NO_AUTH_ACTION_COUNT``: after the few set-up calls, only the IAM
user's key is accepted), so a wrong secret is refused as AWS would refuse it. Clients reach it the way a
user reaches a private S3-compatible server: ``AWS_ENDPOINT_URL_S3`` and the key in the environment.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

_SETUP_CALLS = 3  # create_user, create_access_key, put_user_policy run before authentication is on
_ALLOW_ALL = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}


@dataclass
class S3Server:
    endpoint: str
    access_key: str
    secret_key: str

    def env(self, **extra: str) -> dict[str, str]:
        """The environment variables a client needs (on top of ``os.environ`` or ``cli_env()``)."""
        return {"AWS_ENDPOINT_URL_S3": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true", **extra}

    def client(self):  # noqa: ANN201 (boto3 has no installed type stubs)
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key)

    def create_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return f"s3://{name}"

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(item["Key"] for page in pages for item in page.get("Contents", []))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def s3_server() -> Iterator[S3Server]:
    import boto3

    port = _free_port()
    env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT=str(_SETUP_CALLS))
    process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError("moto's S3 server did not start") from None
                time.sleep(0.1)
        iam = boto3.client("iam", endpoint_url=endpoint, region_name="us-east-1",
                           aws_access_key_id="setup", aws_secret_access_key="setup")
        iam.create_user(UserName="lightning-train")
        key = iam.create_access_key(UserName="lightning-train")["AccessKey"]
        iam.put_user_policy(UserName="lightning-train", PolicyName="all",
                            PolicyDocument=json.dumps(_ALLOW_ALL))
        yield S3Server(endpoint, key["AccessKeyId"], key["SecretAccessKey"])
    finally:
        process.terminate()
        process.wait(timeout=30)
