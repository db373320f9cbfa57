"""What the embedded broker runs: Kafka's jars (pinned by ``pom.xml``), its config templates
(``server.properties``, ``log4j2.properties``) and :mod:`rollbus.kafka.runtime`, which fetches and
prepares them."""
