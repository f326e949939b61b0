"""A streaming step's rank receiving on a thread, for the streaming tests."""
import threading
import time

import packd


class Receiver(threading.Thread):
    """A rank's receiving stream on a thread: its micro-batches, or the error it ended with.
    `seconds_each`: how long the rank takes over each micro-batch (a slow reader)."""

    def __init__(self, client, step_id, rank, seconds_each=0.0, **kwargs):
        super().__init__(daemon=True)
        self.stream = client.receive_step(step_id, rank, **kwargs)
        self.micro_batches, self.error = [], None
        self._seconds_each = seconds_each
        self.start()

    def run(self):
        try:
            for mb in self.stream:
                self.micro_batches.append(mb)
                time.sleep(self._seconds_each)
        except packd.PackdError as e:
            self.error = e
