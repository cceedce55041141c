package sos.hadoop;

import org.apache.hadoop.hdfs.client.HdfsClientConfigKeys;
import org.apache.hadoop.hdfs.web.WebHdfsConstants;
import org.apache.hadoop.io.Text;

/** {@link RideThroughWebHdfsFileSystem} over https: {@code swebhdfs://}, as SWebHdfsFileSystem. */
public class RideThroughSWebHdfsFileSystem extends RideThroughWebHdfsFileSystem {
  @Override
  public String getScheme() {
    return WebHdfsConstants.SWEBHDFS_SCHEME;
  }

  @Override
  protected String getTransportScheme() {
    return "https";
  }

  @Override
  protected Text getTokenKind() {
    return WebHdfsConstants.SWEBHDFS_TOKEN_KIND;
  }

  @Override
  protected int getDefaultPort() {
    return HdfsClientConfigKeys.DFS_NAMENODE_HTTPS_PORT_DEFAULT;
  }
}
