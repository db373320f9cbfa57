"""The Kafka layer: everything rollbus does with Kafka goes through this package.

* :mod:`~rollbus.kafka.clients` builds every producer, consumer, admin client and metadata probe;
* :mod:`~rollbus.kafka.watermark` is the low-watermark commit rule (work ending out of order commits
  only up to its oldest unfinished offset), pure and tested exhaustively;
* :mod:`~rollbus.kafka.in_flight` is the consumer loop of services whose work outlives many polls;
* :mod:`~rollbus.kafka.read` reads partitions from their beginning to their current end;
* :mod:`~rollbus.kafka.reach` (is a broker there), :mod:`~rollbus.kafka.topics` (the topics, their creation
  and the start-up check), :mod:`~rollbus.kafka.bus` (the event publisher and consumer) and
  :mod:`~rollbus.kafka.replay` (events read back for people: the viewer and ``rollbus replay``) are built
  on them;
* the embedded broker (:mod:`~rollbus.kafka.broker`): Kafka's jars (pinned by ``pom.xml``), its config
  templates (``server.properties``, ``log4j2.properties``) and :mod:`~rollbus.kafka.runtime`, which fetches
  and prepares them.

The segmenter's Faust app builds its own clients (Faust's), and is the one exception.
"""
